"""One encoder shape: a protocol produces its event sequence once; the shared base frames
it for the stream (keep-alive, mid-stream errors, closing) or folds it into the JSON body.

A protocol supplies a per-request `EventEncoder` (its events for each pipeline event,
plus opening and closing events) and a `fold` of those events into the non-streaming
body, so that the JSON answer and the stream are the same message by construction. The
stream is SSE (`sse_frames`) unless the protocol brings its own `Framing` (Ollama's
NDJSON: `ndjson_frames`).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pipeserve.api.sse import sse_comment, sse_event
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError
from pipeserve.events import Event, KeepAlive

KEEPALIVE_COMMENT = sse_comment("keep-alive")


@dataclass(slots=True)
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
        """A KeepAlive's events; by default left to the framing (an SSE comment), which a
        fold never sees."""
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


def frames(
    encoder: EventEncoder, events: Iterable[Event], ctx: RequestContext
) -> Iterator[Frame | KeepAlive]:
    """The protocol's events for a pipeline stream (KeepAlive: left to the framing)."""
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


def ndjson_line(data: Mapping[str, Any]) -> bytes:
    """One NDJSON line: compact JSON (never a raw newline inside) and a newline."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def _sse_event(frame: Frame) -> bytes:
    return sse_event(frame.data, frame.name)


def _ndjson_event(frame: Frame) -> bytes:
    if not isinstance(frame.data, Mapping):
        raise TypeError(f"an NDJSON frame is one JSON object, not {frame.data!r}")
    return ndjson_line(frame.data)


@dataclass(frozen=True, slots=True)
class Framing:
    """How a stream's protocol events become bytes: `event` writes one Frame; `keepalive`
    is written for a KeepAlive the encoder leaves to the framing (its default
    `keepalive()`). None: nothing is written, so an encoder whose framing has no comment
    line (NDJSON) sends its own keep-alive object from `keepalive()` (Ollama's empty
    chunk)."""

    event: Callable[[Frame], bytes]
    keepalive: bytes | None


SSE = Framing(_sse_event, KEEPALIVE_COMMENT)
NDJSON = Framing(_ndjson_event, None)


def framed(
    encoder: EventEncoder, events: Iterable[Event], ctx: RequestContext, framing: Framing
) -> Iterator[bytes]:
    """The streamed body: each protocol event written by `framing`."""
    for frame in frames(encoder, events, ctx):
        if not isinstance(frame, KeepAlive):
            yield framing.event(frame)
        elif framing.keepalive is not None:
            yield framing.keepalive


def sse_frames(
    encoder: EventEncoder, events: Iterable[Event], ctx: RequestContext
) -> Iterator[bytes]:
    """The SSE body: each protocol event framed (a KeepAlive ping as a comment)."""
    return framed(encoder, events, ctx, SSE)


def ndjson_frames(
    encoder: EventEncoder, events: Iterable[Event], ctx: RequestContext
) -> Iterator[bytes]:
    """The NDJSON body: each protocol event one line (keep-alives are the encoder's)."""
    return framed(encoder, events, ctx, NDJSON)


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
    "KEEPALIVE",
    "KEEPALIVE_COMMENT",
    "NDJSON",
    "SSE",
    "EventEncoder",
    "Frame",
    "Framing",
    "close_events",
    "framed",
    "frames",
    "json_frames",
    "ndjson_frames",
    "ndjson_line",
    "sse_frames",
]
