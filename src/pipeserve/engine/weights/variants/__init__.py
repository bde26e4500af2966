"""pipeserve's own variants of mlx-lm model classes, chosen by config.json's `model_type`
(data: `VARIANTS`); every other model type loads mlx-lm's class as it is.

A variant keeps mlx-lm's modules and parameter names (weights, the CPU kernels' swaps,
LoRA and the prefix cache see the same model) and adds what mlx-lm's class leaves out:

- `gemma2`: Gemma 2's sliding-window layers (gemma2.py); mlx-lm's gemma2 attends
  globally in every layer, so its outputs part from the model's own (and llama.cpp's)
  once a prompt and its answer pass the window.
"""

from __future__ import annotations

import importlib
from typing import Any

# config.json model_type -> the module whose Model / ModelArgs replace mlx-lm's
VARIANTS: dict[str, str] = {"gemma2": "pipeserve.engine.weights.variants.gemma2"}


def model_classes(config: dict[str, Any]) -> tuple[type, type]:
    """(Model, ModelArgs) for `config`: a variant's where VARIANTS names one, else
    mlx-lm's (its own lookup, remappings included). mlx-lm's load_model takes this as
    `get_model_classes`."""
    from mlx_lm.utils import _get_classes

    variant = VARIANTS.get(str(config.get("model_type")))
    if variant is None:
        classes: tuple[type, type] = _get_classes(config)
        return classes
    module = importlib.import_module(variant)
    return module.Model, module.ModelArgs
