"""The engine contract: what the `generate` stage submits and what it gets back.

An engine owns one loaded model (or a tokenizer only, for replay) and runs generation
off the gevent hub. `submit` returns a TokenStream that yields, in order:
PromptReady, TokenText per generated token, then exactly one Finish and one Usage.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pipeserve.config.models import ReasoningLimits
from pipeserve.events import Event
from pipeserve.request import SamplingParams

if TYPE_CHECKING:
    from pipeserve.engine.embedding.spec import EmbeddingSpec
    from pipeserve.engine.sampling.grammar import Constraint, GrammarCompiler


@dataclass(frozen=True, slots=True)
class ThinkingLimit:
    """A think block's token budget (engine/sampling/thinking_budget.py). Once `budget`
    reasoning tokens are spent inside the block the engine feeds `close_ids` as the next
    tokens (the family's end marker and what follows it), as a grammar forces text, and
    the answer is generated after them. start_ids / end_ids: the markers as the model
    writes them; opened: the prompt itself opened the block."""

    budget: int
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    close_ids: tuple[int, ...]
    opened: bool = False


@dataclass(slots=True)
class GenerationJob:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    logprobs: bool = False
    top_logprobs: int = 0
    mock_completion: str | None = None  # replay engine: the raw completion to stream
    keepalive_interval: float | None = None  # seconds of silence before a KeepAlive event
    constraint: Constraint | None = None  # structured output: the grammar to enforce
    stop_strings: tuple[str, ...] = ()  # the request's stop strings (speculation stops there)
    prediction_token_ids: list[int] | None = None  # Chat's `prediction`, tokenized
    thinking: ThinkingLimit | None = None  # a budget for the think block (None: unlimited)
    # A request's n choices: the jobs of one group share the prompt, prefilled once
    # (engine/mlx/prompt_groups.py); engines without that prefill each job alone.
    prompt_group: str | None = None
    group_size: int = 1
    adapter: str | None = None  # the model's LoRA adapter for this job (None: the base)


class TokenStream(Protocol):
    def __iter__(self) -> Iterator[Event]: ...

    def cancel(self) -> None:
        """Stop generating for this job; the engine frees its slot within one step."""


class Engine(Protocol):
    """What stages and the server use of an engine (MlxEngine, ReplayEngine, ShardedEngine,
    the server's ManagedEngine and RemoteEngine wrappers). Every member is declared here,
    so the server never probes an engine with getattr."""

    accepts_mock_response: bool  # the request's mock_response is replayed (replay only)
    max_tokens_limit: int | None  # upper bound on a request's max_tokens

    def submit(self, job: GenerationJob) -> TokenStream:
        """Queue a job. Raises ApiError("overloaded") when the model's queue is full."""

    def stats(self) -> dict[str, float]:
        """Live counters for the metrics endpoint."""

    @property
    def healthy(self) -> bool:
        """False when the engine cannot serve at all (a sharded model whose group was lost,
        an engine host that is down): `/health` answers 503."""

    @property
    def health_reason(self) -> str:
        """Why the engine is not healthy ("" while it is)."""

    def describe(self) -> dict[str, Any]:
        """Residency facts for /v1/models (state, load policy, memory); {} when the engine
        is not managed by a fleet (always resident)."""

    def close(self) -> None: ...


class AlwaysHealthy:
    """The health and residency members of an engine that cannot lose its model."""

    @property
    def healthy(self) -> bool:
        return True

    @property
    def health_reason(self) -> str:
        return ""

    def describe(self) -> dict[str, Any]:
        return {}


@dataclass
class ModelRuntime:
    """One loaded model as stages see it: tokenizer, engine and family facts."""

    name: str
    family: str
    model_dir: Path
    tokenizer: Any  # mlx_lm.tokenizer_utils.TokenizerWrapper
    engine: Engine
    eos_token_ids: frozenset[int]
    context_length: int | None = None
    default_max_tokens: int = 4096
    grammar: GrammarCompiler | None = None  # structured output (None: not available)
    # Sampling parameters for requests that leave them unset (YAML, else generation_config).
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    # Thinking budgets (the YAML's `reasoning:`): cap and per-effort table.
    reasoning: ReasoningLimits = field(default_factory=ReasoningLimits)
    embedding: EmbeddingSpec | None = None  # kind embedding / rerank: pooling, dimensions
