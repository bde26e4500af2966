"""Token vectors -> one vector per input: pooling over the real tokens (padding never
counts), then Matryoshka truncation and L2 normalisation."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from pipeserve.engine.embedding.spec import Pooling


def pool(hidden: mx.array, mask: mx.array, lengths: mx.array, how: Pooling) -> mx.array:
    """hidden [batch, length, width], mask [batch, length] (1: real token), lengths [batch]
    -> [batch, width]. `last` is the last real token (inputs are padded on the right)."""
    if how == "cls":
        return hidden[:, 0]
    if how == "last":
        index = (lengths - 1).astype(mx.int32)
        return mx.take_along_axis(hidden, index[:, None, None], axis=1)[:, 0]
    weights = mask.astype(hidden.dtype)[..., None]
    return (hidden * weights).sum(axis=1) / mx.maximum(weights.sum(axis=1), 1.0)


def finish(vector: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """Cut to the first `dimensions` (Matryoshka), then scale to unit length."""
    out = vector[:dimensions] if dimensions is not None else vector
    if normalize:
        norm = float(np.linalg.norm(out))
        out = out / max(norm, 1e-12)
    return out.astype(np.float32)
