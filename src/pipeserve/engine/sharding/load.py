"""Loading one rank's share of a model: lazy load, shard or split, then evaluate.

With a lazy load nothing is read from disk until `mx.eval`; after `Model.shard` (tensor)
or the layer split (pipeline) only this rank's slices and layers are evaluated, so each
rank holds about 1/ranks of the transformer-layer weights. Embeddings, the final norm
and the output head stay whole on every rank (every rank computes the logits).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from pipeserve.config.models import EngineOptions
from pipeserve.engine.cpu_kernels import transposed
from pipeserve.engine.sharding import support
from pipeserve.engine.sharding.cpu_twins import register as register_cpu_twins
from pipeserve.engine.sharding.pipeline import split_layers
from pipeserve.engine.weights.dtype import DTYPES

log = logging.getLogger("pipeserve.sharding")

# Written by a cluster node into a model folder that holds only the weight files of its
# own layers (cluster/files.py): the other layers' weights are absent by design.
PARTIAL_MARKER = ".pipeserve-partial"


def load_shard(model_dir: Path, options: EngineOptions, group: Any) -> Any:
    """This rank's model, evaluated; call on the engine thread (MLX arrays and streams)."""
    from mlx_lm.utils import load_model

    from pipeserve.engine.weights.variants import model_classes

    sharding = options.sharding
    assert sharding is not None
    started = time.monotonic()
    partial = (model_dir / PARTIAL_MARKER).exists()
    model, config = load_model(
        model_dir, lazy=True, strict=not partial, get_model_classes=model_classes
    )
    problems = support.sharding_problems(config, sharding.strategy, group.size(), sharding.split)
    if problems:
        raise ValueError("; ".join(problems))
    where = _shard(model, config, sharding.strategy, sharding.split, group)
    if options.dtype != "auto":
        if options.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {options.dtype!r}")
        model.set_dtype(getattr(mx, options.dtype))
    mx.eval(model.parameters())
    if options.cpu_pretranspose and transposed.applies_here():
        register_cpu_twins()
        count = transposed.pretranspose_dense_weights(model)
        log.info("rank %d: %d matrices stored transposed for the CPU BLAS", group.rank(), count)
    total, layers = weight_bytes(model)
    log.info("rank %d/%d: %s; weights %d bytes, of which transformer layers %d (%.1f s)",
             group.rank(), group.size(), where, total, layers, time.monotonic() - started)  # fmt: skip
    return model


def _shard(model: Any, config: dict[str, Any], strategy: str, split: Any, group: Any) -> str:
    if strategy == "tensor":
        model.shard(group)
        return "tensor slice"
    module = support.architecture_module(config)
    inner = model.model
    if support.has_native_pipeline(module) and hasattr(inner, "pipeline"):
        inner.pipeline(group, split)
        return f"layers [{inner.start_idx}, {inner.end_idx}) via mlx-lm's pipeline()"
    start, end = split_layers(model, group, split, support.module_name(module))
    return f"layers [{start}, {end}) via pipeserve's adapter"


def weight_bytes(model: Any) -> tuple[int, int]:
    """(all parameter bytes, those of the transformer layers) held by this rank."""
    params = tree_flatten(model.parameters())
    total = sum(v.nbytes for _, v in params)
    layers = sum(v.nbytes for k, v in params if ".layers." in f".{k}")
    return total, layers
