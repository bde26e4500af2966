"""Which architectures can be sharded how, and why not: shared by validation and loading.

Works from a model's config.json alone (no weights, no MLX arrays), so `pipeserve
validate` and the server's master process can call it.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

# Architectures (mlx-lm module names) pipeserve's own layer-range adapter covers, for
# those whose mlx-lm module has no pipeline(); see pipeline.py for their fix-ups.
PIPELINE_ADAPTERS: tuple[str, ...] = ("qwen3", "llama", "gpt_oss")

# Config keys whose value tensor sharding divides among the ranks (heads, MLP widths).
DIVIDED_BY_RANKS: tuple[str, ...] = (
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "moe_intermediate_size",
)


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's section of a config (multimodal configs nest it)."""
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config


def architecture_module(config: dict[str, Any]) -> ModuleType:
    """mlx-lm's module for this config (after mlx-lm's own model_type remapping)."""
    from mlx_lm.utils import _get_classes

    model_class, _ = _get_classes(config)
    return sys.modules[model_class.__module__]


def has_native_pipeline(module: ModuleType) -> bool:
    """mlx-lm's own pipeline(): some nn.Module class of the module defines it."""
    from mlx import nn

    return any(
        isinstance(obj, type) and issubclass(obj, nn.Module) and hasattr(obj, "pipeline")
        for obj in vars(module).values()
    )


def module_name(module: ModuleType) -> str:
    return module.__name__.rsplit(".", 1)[-1]


def pipeline_supported() -> str:
    """The supported list, for error messages."""
    return (
        "mlx-lm's pipeline() (e.g. qwen3_moe, glm4_moe, deepseek_v3, qwen2) or pipeserve's"
        f" adapter ({', '.join(PIPELINE_ADAPTERS)})"
    )


def sharding_problems(
    config: dict[str, Any], strategy: str, ranks: int, split: list[int] | None
) -> list[str]:
    """What stops this model from being sharded this way on `ranks` ranks (empty: fine)."""
    try:
        module = architecture_module(config)
    except (ValueError, KeyError, ImportError) as exc:
        return [f"cannot tell the architecture: {exc}"]
    name = module_name(module)
    text = text_config(config)
    if strategy == "tensor":
        return _tensor_problems(module, name, text, ranks)
    return _pipeline_problems(module, name, text, ranks, split)


def _tensor_problems(module: ModuleType, name: str, text: dict[str, Any], ranks: int) -> list[str]:
    if not hasattr(getattr(module, "Model", None), "shard"):
        message = f"tensor sharding: architecture {name!r} has no shard() in mlx-lm"
        return [message + "; try strategy: pipeline"]
    problems = []
    for key in DIVIDED_BY_RANKS:
        value = text.get(key)
        if isinstance(value, int) and value % ranks:
            problems.append(f"tensor sharding: {key} = {value} does not divide by {ranks} ranks")
    return problems


def _pipeline_problems(
    module: ModuleType, name: str, text: dict[str, Any], ranks: int, split: list[int] | None
) -> list[str]:
    if not has_native_pipeline(module) and name not in PIPELINE_ADAPTERS:
        message = f"pipeline sharding: architecture {name!r} is not supported"
        return [f"{message}; supported: {pipeline_supported()}"]
    layers = text.get("num_hidden_layers")
    if not isinstance(layers, int):
        return []
    if layers < ranks:
        return [f"pipeline sharding: {layers} layers cannot be split over {ranks} ranks"]
    if split is not None and sum(split) != layers:
        return [f"split {split} sums to {sum(split)}, not to the model's {layers} layers"]
    return []


def backend_problem(backend: str) -> str | None:
    import mlx.core as mx

    if mx.distributed.is_available(backend):
        return None
    built = [b for b in ("ring", "mpi", "jaccl", "nccl") if mx.distributed.is_available(b)]
    return f"backend {backend!r} is not available in this MLX build (available: {', '.join(built)})"


def load_module(name: str) -> ModuleType:
    return importlib.import_module(f"mlx_lm.models.{name}")
