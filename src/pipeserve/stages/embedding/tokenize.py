"""tokenize: the inputs as token sequences with the model's own tokenizer (its special
tokens added), token arrays checked against the vocabulary; longer than max_length: cut
when the request says `truncate`, else a 400 naming the input (engine/embedding/inputs.py)."""

from __future__ import annotations

from pipeserve.engine.embedding.inputs import InputTokenizer
from pipeserve.stages.base import StageParams
from pipeserve.stages.embedding.base import EmbedContext, EmbedStage, register_embed_stage


class TokenizeParams(StageParams):
    pass


@register_embed_stage("tokenize", TokenizeParams)
def tokenize(params: TokenizeParams) -> EmbedStage:
    """The inputs as token sequences (the model's tokenizer.json; limits checked)."""
    return tokenize_inputs


def tokenize_inputs(ctx: EmbedContext) -> None:
    tokenizer = ctx.runtime.tokenizer
    assert isinstance(tokenizer, InputTokenizer)
    if ctx.pairs is not None:
        ctx.sequences = tokenizer.pairs(ctx.pairs[0], ctx.pairs[1], ctx.truncate)
    elif ctx.scoring:
        ctx.sequences = tokenizer.texts(ctx.texts or [], "documents", ctx.truncate)
    elif ctx.texts is not None:
        ctx.sequences = tokenizer.texts(ctx.texts, ctx.field_name, ctx.truncate, ctx.single)
    else:
        arrays = ctx.token_arrays or []
        ctx.sequences = tokenizer.token_arrays(arrays, ctx.field_name, ctx.truncate, ctx.single)
    ctx.tokens = sum(len(s.ids) for s in ctx.sequences)
