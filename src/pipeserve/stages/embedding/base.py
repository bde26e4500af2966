"""The embedding chain's contract: a per-request EmbedContext that each stage fills in
turn, and the registry of embedding stage kinds (separate from the generation stages':
an embedding pipeline cannot hold a generate stage, nor a chat pipeline a pool stage)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias, TypeVar

import numpy as np
from pydantic import BaseModel

from pipeserve.config.models import EmbeddingOptions

if TYPE_CHECKING:
    from pipeserve.engine.base import ModelRuntime
    from pipeserve.engine.embedding.jobs import Sequence


@dataclass
class EmbedContext:
    """One request on its way through the chain, protocol-neutral (the route fills the
    request's part). Each stage fills its part in turn: embed_input the inputs (texts,
    pairs or token arrays), tokenize the sequences, encode the token vectors per input
    ([length, width]) or the scores, pool one vector per input, normalize the answer."""

    runtime: ModelRuntime
    options: EmbeddingOptions  # the entry's `embedding:` (limits, rerank template)
    request_id: str
    submit: Callable[[Any], Any]  # the route's: EmbedJob -> EmbedResult (waits, cancels)
    scoring: bool = False  # rerank: one relevance score per document
    field_name: str = "input"  # the body's name for the inputs (errors name it)
    single: bool = False  # one input, not a list
    truncate: bool = False
    asked_dimensions: int | None = None
    query: str = ""  # rerank
    documents: list[str] = field(default_factory=list)  # rerank
    texts: list[str] | None = None
    pairs: tuple[str, list[str]] | None = None  # a cross-encoder's (query, documents)
    token_arrays: list[list[int]] | None = None
    dimensions: int | None = None  # Matryoshka: cut to this many (embed_input checked it)
    sequences: list[Sequence] = field(default_factory=list)
    tokens: int = 0
    vectors: list[np.ndarray] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)


class EmbedStage(Protocol):
    def __call__(self, ctx: EmbedContext) -> None: ...


@dataclass(frozen=True)
class EmbedStageSpec:
    kind: str
    params_model: type[BaseModel]
    factory: Callable[[Any], EmbedStage]
    description: str
    role: Literal["transform"] = "transform"  # the chain runs in order: no roles


EMBED_STAGE_REGISTRY: dict[str, EmbedStageSpec] = {}
P = TypeVar("P", bound=BaseModel)
EmbedFactory: TypeAlias = Callable[[P], EmbedStage]


def register_embed_stage(
    kind: str, params: type[P]
) -> Callable[[Callable[[P], EmbedStage]], Callable[[P], EmbedStage]]:
    """Register an embedding stage factory under `kind` (YAML names it so)."""

    def decorator(factory: Callable[[P], EmbedStage]) -> Callable[[P], EmbedStage]:
        if kind in EMBED_STAGE_REGISTRY:
            raise ValueError(f"embedding stage kind {kind!r} registered twice")
        text = ((factory.__doc__ or "").strip().splitlines() or [""])[0]
        EMBED_STAGE_REGISTRY[kind] = EmbedStageSpec(kind, params, factory, text)
        return factory

    return decorator


class EmbedChain:
    """The built stages of one embedding / rerank model, run in order per request."""

    def __init__(self, stages: list[EmbedStage]) -> None:
        self.stages = stages

    def run(self, ctx: EmbedContext) -> None:
        for stage in self.stages:
            stage(ctx)
