"""embed_input: the request's inputs, within the model's limits (the chain's first stage)."""

from __future__ import annotations

from pipeserve.engine.embedding.backbone import is_encoder
from pipeserve.errors import invalid
from pipeserve.stages.base import StageParams
from pipeserve.stages.embedding.base import EmbedContext, EmbedStage, register_embed_stage

# Qwen3-Reranker's chat prompt: a decoder reranker's default rerank_template.
DEFAULT_RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the"
    ' Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
    "<|im_end|>\n<|im_start|>user\n<Instruct>: {instruction}\n<Query>: {query}\n"
    "<Document>: {document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


class EmbedInputParams(StageParams):
    pass


@register_embed_stage("embed_input", EmbedInputParams)
def embed_input(params: EmbedInputParams) -> EmbedStage:
    """The inputs: texts or token arrays; to rerank, (query, document) pairs for a
    cross-encoder or one yes/no prompt per document (rerank_template) for a decoder."""
    return take_inputs


def take_inputs(ctx: EmbedContext) -> None:
    options = ctx.options
    if ctx.scoring:
        check_count(len(ctx.documents), options.max_inputs, "documents")
        if is_encoder(ctx.runtime.model_dir):
            ctx.pairs = (ctx.query, ctx.documents)
            return
        template = options.rerank_template or DEFAULT_RERANK_TEMPLATE
        instruction = options.rerank_instruction
        ctx.texts = [
            template.format(instruction=instruction, query=ctx.query, document=d)
            for d in ctx.documents
        ]
        return
    count = len(ctx.texts if ctx.texts is not None else ctx.token_arrays or [])
    check_count(count, options.max_inputs, ctx.field_name)
    spec = ctx.runtime.embedding
    assert spec is not None
    ctx.dimensions = check_dimensions(ctx.asked_dimensions, spec.dimensions, spec.matryoshka)


def check_count(count: int, limit: int, field: str) -> None:
    if count > limit:
        raise invalid(
            f"'{field}' has {count} items; this model takes at most {limit} per request", field
        )


def check_dimensions(asked: int | None, native: int, matryoshka: bool) -> int | None:
    if asked is None or asked == native:
        return None
    if asked > native:
        raise invalid(
            f"'dimensions' is {asked}; this model's vectors have {native} dimensions", "dimensions"
        )
    if not matryoshka:
        raise invalid(
            f"'dimensions': this model's vectors have {native} dimensions and it is not"
            " configured for shorter ones (embedding.matryoshka)",
            "dimensions",
        )
    return asked
