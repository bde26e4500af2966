"""What an embeddings or rerank request submits to the engine, and what it gets back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

Mode = Literal["embed", "score"]


@dataclass(slots=True)
class Sequence:
    """One input, tokenized: its ids and, for a cross-encoder pair, its segment ids."""

    ids: list[int]
    types: list[int] | None = None


@dataclass(slots=True)
class EmbedJob:
    """mode embed: the token vectors of each sequence (the chain's pool stage makes one
    vector of them); mode score: one relevance score per sequence (a cross-encoder's
    logit, or a decoder's probability of `yes`)."""

    request_id: str
    sequences: list[Sequence]
    mode: Mode = "embed"

    @property
    def tokens(self) -> int:
        return sum(len(s.ids) for s in self.sequences)


@dataclass(slots=True)
class EmbedResult:
    """vectors (embed: [length, width] each) or scores (score), in the order of the job's sequences; error:
    why the job ended without them (cancelled, engine fault, shutdown)."""

    vectors: list[np.ndarray] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None
    error_kind: Literal["cancelled", "internal", "unavailable"] | None = None
