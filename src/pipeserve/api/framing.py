"""One encoder shape: a protocol produces its event sequence once; the shared base frames
it as SSE (keep-alive, mid-stream errors, closing) or folds it into the JSON body.

A protocol supplies a per-request `EventEncoder` (its events for each pipeline event,
plus opening and closing events) and a `fold` of those events into the non-streaming
body, so that the JSON answer and the stream are the same message by construction.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from pipeserve.api.sse import sse_comment, sse_event
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError
from pipeserve.events import Event, KeepAlive

KEEPALIVE_COMMENT = sse_comment("keep-alive")


@dataclass(frozen=True, slots=True)
class Frame:
    """One protocol event: its data, its SSE `event:` name (None: data only), and for the
    error event the ApiError it renders (a fold raises it: the JSON answer is an error)."""

    data: dict[str, Any] | str
    name: str | None = None
    error: ApiError | None = None


class EventEncoder(ABC):
    """One request's protocol events.

    `feed` may raise ApiError: the base then sends the protocol's error events (`error`)
    and ends there. An encoder may also end the stream itself by setting `done` (and
    `failed` when its last event was an error). After the end the rest of the pipeline
    stream is drained, so Usage still reaches wrappers such as metrics; after an error,
    generation is cancelled first so that the drain is short.
    """

    @property
    def done(self) -> bool:
        return False

    @property
    def failed(self) -> bool:
        return False

    def open(self) -> Iterable[Frame]:
        return ()

    @abstractmethod
    def feed(self, event: Event) -> Iterable[Frame]: ...

    def keepalive(self) -> Iterable[Frame | KeepAlive]:
        """A KeepAlive's events; by default an SSE comment (which a fold ignores)."""
        return (KEEPALIVE,)

    def close(self) -> Iterable[Frame]:
        """The pipeline stream ended before the encoder did."""
        return ()

    @abstractmethod
    def error(self, err: ApiError) -> Iterable[Frame]: ...


KEEPALIVE = KeepAlive()


def close_events(events: Iterable[Event]) -> None:
    """Close the upstream generator chain so stages and the engine job are released."""
    close = getattr(events, "close", None)  # generators, and wrappers that close theirs
    if close is not None:
        close()


class ChunkState(Protocol):
    """A protocol's per-request object state for encoders that stream plain objects
    (Completions, Ollama): done after its last object, failed after an error object."""

    done: bool
    failed: bool

    def handle(self, event: Event) -> Iterator[dict[str, Any]]: ...

    def close(self) -> Iterator[dict[str, Any]]: ...


def chunks_then_drain(
    state: ChunkState, events: Iterable[Event], ctx: RequestContext
) -> Iterator[dict[str, Any]]:
    """The state's objects for the pipeline events. After the last one (done, error, or a
    cancelled end) the rest of the pipeline stream is drained, so Usage still reaches
    wrappers such as metrics; after an error, generation is cancelled first so the drain
    is short."""
    stream = iter(events)
    for event in stream:
        yield from state.handle(event)
        if state.done:
            break
    else:
        yield from state.close()
        return
    if state.failed:
        ctx.cancel("error")
    for _ in stream:
        pass


def frames(
    encoder: EventEncoder, events: Iterable[Event], ctx: RequestContext
) -> Iterator[Frame | KeepAlive]:
    """The protocol's events for a pipeline stream (KeepAlive: a comment ping)."""
    yield from encoder.open()
    stream = iter(events)
    failed = False
    for event in stream:
        if type(event) is KeepAlive:
            yield from encoder.keepalive()
            continue
        try:
            out = list(encoder.feed(event))
        except ApiError as err:
            out, failed = list(encoder.error(err)), True
        yield from out
        if failed or encoder.done:
            break
    else:
        yield from encoder.close()
        return
    if failed or encoder.failed:
        ctx.cancel("error")
    for _ in stream:
        pass


def sse_frames(
    encoder: EventEncoder, events: Iterable[Event], ctx: RequestContext
) -> Iterator[bytes]:
    """The SSE body: each protocol event framed (a KeepAlive ping as a comment)."""
    for frame in frames(encoder, events, ctx):
        if isinstance(frame, KeepAlive):
            yield KEEPALIVE_COMMENT
        else:
            yield sse_event(frame.data, frame.name)


def json_frames(
    encoder: EventEncoder, events: Iterable[Event], ctx: RequestContext
) -> Iterator[Frame]:
    """The protocol events a fold reads: no comment pings; an error event that carries
    its ApiError raises it."""
    for frame in frames(encoder, events, ctx):
        if isinstance(frame, KeepAlive):
            continue
        if frame.error is not None:
            raise frame.error
        yield frame


__all__ = [
    "ChunkState",
    "chunks_then_drain",
    "KEEPALIVE",
    "KEEPALIVE_COMMENT",
    "EventEncoder",
    "close_events",
    "Frame",
    "frames",
    "json_frames",
    "sse_frames",
]
