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
from typing import Any

from pipeserve.api.sse import sse_comment, sse_event
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
    """One request's protocol events. `feed` may raise ApiError: the base then sends the
    protocol's error events (`error`) and ends the stream there."""

    def open(self) -> Iterable[Frame]:
        return ()

    @abstractmethod
    def feed(self, event: Event) -> Iterable[Frame]: ...

    def close(self) -> Iterable[Frame]:
        return ()

    @abstractmethod
    def error(self, err: ApiError) -> Iterable[Frame]: ...


def frames(encoder: EventEncoder, events: Iterable[Event]) -> Iterator[Frame | KeepAlive]:
    """The protocol's events for a pipeline stream; KeepAlive passes through (the framing
    turns it into a ping, a fold ignores it)."""
    yield from encoder.open()
    for event in events:
        if type(event) is KeepAlive:
            yield event
            continue
        try:
            out = encoder.feed(event)
        except ApiError as err:
            yield from encoder.error(err)
            return
        yield from out
    yield from encoder.close()


def sse_frames(
    encoder: EventEncoder, events: Iterable[Event], keepalive: bytes = KEEPALIVE_COMMENT
) -> Iterator[bytes]:
    """The SSE body: each protocol event framed, each KeepAlive as `keepalive`."""
    for frame in frames(encoder, events):
        if isinstance(frame, KeepAlive):
            yield keepalive
        else:
            yield sse_event(frame.data, frame.name)


def json_frames(encoder: EventEncoder, events: Iterable[Event]) -> Iterator[Frame]:
    """The protocol events a fold reads: no keep-alives; an error event raises its ApiError."""
    for frame in frames(encoder, events):
        if isinstance(frame, KeepAlive):
            continue
        if frame.error is not None:
            raise frame.error
        yield frame


__all__ = ["KEEPALIVE_COMMENT", "EventEncoder", "Frame", "frames", "json_frames", "sse_frames"]
