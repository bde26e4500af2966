"""The embedding chain's stage kinds (pipelines/embedding.yaml, pipelines/rerank.yaml):
input -> tokenize -> encode -> pool -> normalize. Each module registers one kind;
`load_embed_stages()` imports them. The protocol's body is the route's (api/embeddings),
as a generation route's is."""

from __future__ import annotations

import importlib

from pipeserve.stages.embedding.base import (
    EMBED_STAGE_REGISTRY,
    EmbedChain,
    EmbedContext,
    EmbedStage,
    EmbedStageSpec,
    register_embed_stage,
)

EMBED_STAGE_MODULES: tuple[str, ...] = ("embed_input", "tokenize", "encode", "pool", "normalize")


def load_embed_stages() -> dict[str, EmbedStageSpec]:
    for module in EMBED_STAGE_MODULES:
        importlib.import_module(f"pipeserve.stages.embedding.{module}")
    return EMBED_STAGE_REGISTRY


__all__ = [
    "EMBED_STAGE_MODULES",
    "EMBED_STAGE_REGISTRY",
    "EmbedChain",
    "EmbedContext",
    "EmbedStage",
    "EmbedStageSpec",
    "load_embed_stages",
    "register_embed_stage",
]
