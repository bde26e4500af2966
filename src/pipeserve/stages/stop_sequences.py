"""`stop_sequences`: end the response at the first request stop string in the content.

A possible partial match is held back (never streamed) until it either completes or
stops matching. On a match the text before it is released, generation is cancelled
(`ctx.cancel("stop_sequence")`), `Finish("stop", stop_sequence=S)` is emitted, and the
rest of the stream is dropped except Usage. Tool-call arguments are never scanned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from pipeserve.events import (
    ContentDelta,
    Event,
    Finish,
    KeepAlive,
    PromptReady,
    ReasoningDelta,
    TokenText,
    Usage,
)
from pipeserve.stages.base import BuildEnv, RequestContext, StageParams, register_stage
from pipeserve.stages.toolfmt.markers import MarkerSet, Splitter

_TEXT = (ContentDelta, ReasoningDelta, TokenText)
_NO_FLUSH = (KeepAlive, PromptReady, Usage)


class StopSequencesParams(StageParams):
    include_reasoning: bool = False  # also end the response on a stop string in reasoning


class _Scanner:
    """One text stream (content or reasoning) with its held-back partial match."""

    def __init__(self, stops: MarkerSet) -> None:
        self.stops = stops
        self.splitter = Splitter()
        self.last: ContentDelta | ReasoningDelta | TokenText | None = None

    def feed(
        self, event: ContentDelta | ReasoningDelta | TokenText
    ) -> tuple[Event | None, str | None]:
        """(event to emit with the released text, matched stop string)."""
        buf = self.splitter.take(event.text)
        before, stop, after = self.splitter.split(buf, self.stops)
        if stop is None:
            self.splitter.held = after
        self.last = event
        return (dataclasses.replace(event, text=before) if before else None), stop

    def flush(self) -> Event | None:
        held = self.splitter.flush()
        return dataclasses.replace(self.last, text=held) if held and self.last is not None else None


class StopSequencesStage:
    def __init__(self, params: StopSequencesParams) -> None:
        self.params = params

    def prepare(self, ctx: RequestContext) -> None:
        return None

    def __call__(self, events: Iterator[Event], ctx: RequestContext) -> Iterator[Event]:
        stops = MarkerSet(ctx.request.stop)
        if not stops:
            yield from events
            return
        content, reasoning = _Scanner(stops), _Scanner(stops)
        for event in events:
            kind = type(event)
            if kind in _TEXT and (kind is not ReasoningDelta or self.params.include_reasoning):
                scanner = reasoning if kind is ReasoningDelta else content
                released, stop = scanner.feed(event)  # type: ignore[arg-type]
                if released is not None:
                    yield released
                if stop is not None:
                    yield from self._stop(stop, events, ctx)
                    return
                continue
            if kind not in _NO_FLUSH:
                for scanner in (reasoning, content):
                    held = scanner.flush()
                    if held is not None:
                        yield held
            yield event
        for scanner in (reasoning, content):
            held = scanner.flush()
            if held is not None:
                yield held

    def _stop(self, stop: str, events: Iterator[Event], ctx: RequestContext) -> Iterator[Event]:
        ctx.cancel("stop_sequence")
        yield Finish("stop", stop_sequence=stop)
        for event in events:  # drain: the rest (and the upstream "cancelled") is dropped
            if type(event) is Usage:
                yield event


@register_stage("stop_sequences", StopSequencesParams)
def build_stop_sequences(params: StopSequencesParams, env: BuildEnv) -> StopSequencesStage:
    """End the response at the first request stop string, never streaming part of it."""
    return StopSequencesStage(params)
