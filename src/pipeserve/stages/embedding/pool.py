"""pool: one vector per input from its token vectors (padding is never among them):
cls (the first token), mean, or last, as the model's files or the entry's
`embedding.pooling` say (engine/embedding/spec.py)."""

from __future__ import annotations

import numpy as np

from pipeserve.engine.embedding.spec import Pooling
from pipeserve.stages.base import StageParams
from pipeserve.stages.embedding.base import EmbedContext, EmbedStage, register_embed_stage


class PoolParams(StageParams):
    pass


@register_embed_stage("pool", PoolParams)
def pool(params: PoolParams) -> EmbedStage:
    """Token vectors -> one vector per input (cls, mean or last: the model's pooling)."""
    return pool_inputs


def pool_inputs(ctx: EmbedContext) -> None:
    if ctx.scoring:
        return
    spec = ctx.runtime.embedding
    assert spec is not None
    ctx.vectors = [pool_tokens(tokens, spec.pooling) for tokens in ctx.vectors]


def pool_tokens(tokens: np.ndarray, how: Pooling) -> np.ndarray:
    """tokens [length, width] (the real tokens of one input) -> [width]."""
    row = 0 if how == "cls" else -1 if how == "last" else None
    out: np.ndarray = tokens[row] if row is not None else tokens.mean(axis=0, dtype=np.float32)
    return out
