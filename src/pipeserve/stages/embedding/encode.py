"""encode: the model's forward pass on the engine thread (engine/embedding/engine.py:
the inputs of every waiting request in padded, length-bucketed batches)."""

from __future__ import annotations

from pipeserve.engine.embedding.jobs import EmbedJob, Mode
from pipeserve.stages.base import StageParams
from pipeserve.stages.embedding.base import EmbedContext, EmbedStage, register_embed_stage


class EncodeParams(StageParams):
    pass


@register_embed_stage("encode", EncodeParams)
def encode(params: EncodeParams) -> EmbedStage:
    """The model's engine: token vectors per input (embed), or a relevance score (rerank)."""
    return encode_inputs


def encode_inputs(ctx: EmbedContext) -> None:
    mode: Mode = "score" if ctx.scoring else "embed"
    result = ctx.submit(EmbedJob(ctx.request_id, ctx.sequences, mode=mode))
    ctx.tokens = result.tokens
    ctx.vectors, ctx.scores = result.vectors, result.scores
