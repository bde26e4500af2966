"""Helpers for engine and generate-stage tests: collect a stream, mlx-lm references."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pipeserve.config.models import EngineOptions, ModelEntry
from pipeserve.engine.base import GenerationJob, ModelRuntime
from pipeserve.engine.speculative.policy import StepCosts
from pipeserve.events import ErrorEvent, Event, Finish, KeepAlive, PromptReady, TokenText, Usage
from pipeserve.request import SamplingParams


@dataclass
class Collected:
    events: list[Event] = field(default_factory=list)

    @property
    def tokens(self) -> list[TokenText]:
        return [e for e in self.events if isinstance(e, TokenText)]

    @property
    def ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens)

    @property
    def ready(self) -> PromptReady:
        (ready,) = [e for e in self.events if isinstance(e, PromptReady)]
        return ready

    @property
    def finish(self) -> Finish:
        (finish,) = [e for e in self.events if isinstance(e, Finish)]
        return finish

    @property
    def usage(self) -> Usage:
        (usage,) = [e for e in self.events if isinstance(e, Usage)]
        return usage

    @property
    def errors(self) -> list[ErrorEvent]:
        return [e for e in self.events if isinstance(e, ErrorEvent)]

    def check_contract(self) -> None:
        """PromptReady first, Finish then Usage last, nothing after."""
        events = [e for e in self.events if not isinstance(e, KeepAlive)]
        assert isinstance(events[0], PromptReady), events[:2]
        assert isinstance(events[-2], Finish) and isinstance(events[-1], Usage), events[-3:]
        assert sum(isinstance(e, (PromptReady, Finish, Usage)) for e in events) == 3


def collect(events: Iterable[Event]) -> Collected:
    out = Collected(list(events))
    out.check_contract()
    return out


def job(
    prompt: list[int], max_tokens: int = 16, stop: Iterable[int] = (), **sampling: Any
) -> GenerationJob:
    sampling.setdefault("temperature", 0.0)
    return GenerationJob(
        "test", list(prompt), SamplingParams(**sampling), max_tokens, frozenset(stop)
    )


def entry(source: str, engine: str = "mlx", **options: Any) -> ModelEntry:
    return ModelEntry(
        name="m", source=source, pipeline="qwen3", engine=engine, options=EngineOptions(**options)
    )


def reference_ids(model: Any, tokenizer: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """What mlx_lm.stream_generate generates (greedy), EOS excluded."""
    import mlx.core as mx
    from mlx_lm import stream_generate

    ids: list[int] = []
    for response in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens):
        if response.finish_reason is None or response.finish_reason == "length":
            ids.append(response.token)
    return ids


def close(runtime: ModelRuntime) -> None:
    runtime.engine.close()


class FreeVerification(StepCosts):
    """Every step costs the same whatever its width: the policy verifies all it can
    (the exactness tests exercise verification on every step, on any machine)."""

    def record(self, batch: int, width: int, seconds: float) -> None:
        pass

    def measured(self, batch: int, width: int) -> bool:
        return True

    def estimate(self, batch: int, width: int) -> float:
        return 1.0
