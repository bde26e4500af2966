"""normalize: Matryoshka truncation to the request's `dimensions`, then L2
normalisation when the model's files or the entry's `embedding.normalize` say so."""

from __future__ import annotations

import numpy as np

from pipeserve.stages.base import StageParams
from pipeserve.stages.embedding.base import EmbedContext, EmbedStage, register_embed_stage


class NormalizeParams(StageParams):
    pass


@register_embed_stage("normalize", NormalizeParams)
def normalize(params: NormalizeParams) -> EmbedStage:
    """Cut to the request's dimensions, then scale to unit length (the model's choice)."""
    return normalize_vectors


def normalize_vectors(ctx: EmbedContext) -> None:
    if ctx.scoring:
        return
    spec = ctx.runtime.embedding
    assert spec is not None
    ctx.vectors = [finish(v, ctx.dimensions, spec.normalize) for v in ctx.vectors]


def finish(vector: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """Cut to the first `dimensions` (Matryoshka), then scale to unit length."""
    out = vector[:dimensions] if dimensions is not None else vector
    if normalize:
        norm = float(np.linalg.norm(out))
        out = out / max(norm, 1e-12)
    return out.astype(np.float32)
