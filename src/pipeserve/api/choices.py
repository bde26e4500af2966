"""A request's n choices (OpenAI Chat and Completions `n`): one encoder per choice, their
chunks merged into one answer.

Each choice runs its own pipeline (its own context, stages and engine job; the jobs
share one prefill) and its own EventEncoder. Streamed, the choices' chunks go out as
they come (`interleave`), each choice's `index` set to its number, all under the first
choice's id; the usage chunk (prompt counted once, completions summed) and `[DONE]` come
once, after every choice ended. Not streamed, each choice's body is folded on its own
and the bodies are merged the same way. The first error ends the answer (the other
choices are cancelled with it).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

from pipeserve.api.framing import (
    KEEPALIVE_COMMENT,
    EventEncoder,
    Frame,
    close_events,
    frames,
    json_frames,
)
from pipeserve.api.sse import sse_event
from pipeserve.context import RequestContext
from pipeserve.events import Event, KeepAlive
from pipeserve.gevent_support import interleave

Fold = Callable[[Iterator[Frame], RequestContext], dict[str, Any]]


def merge_usage(usages: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI usage of n choices: the prompt once, the completions' counts summed."""
    merged = copy.deepcopy(dict(usages[0]))
    for other in usages[1:]:
        merged["completion_tokens"] += other["completion_tokens"]
        details = merged.get("completion_tokens_details") or {}
        for key, value in (other.get("completion_tokens_details") or {}).items():
            if isinstance(value, int) and isinstance(details.get(key), int):
                details[key] += value
    merged["total_tokens"] = merged["prompt_tokens"] + merged["completion_tokens"]
    return merged


def choice_frames(
    encoders: Sequence[EventEncoder],
    streams: Sequence[Iterator[Event]],
    ctxs: Sequence[RequestContext],
) -> Iterator[Frame | KeepAlive]:
    """The merged chunk stream (see the module docstring)."""
    pulls = [frames(e, s, c) for e, s, c in zip(encoders, streams, ctxs, strict=True)]
    usages: dict[int, dict[str, Any]] = {}
    usage_chunk: dict[str, Any] | None = None
    for index, frame in interleave(pulls):
        if isinstance(frame, KeepAlive):
            yield frame
            continue
        data = frame.data
        if frame.error is not None or not isinstance(data, dict) or "choices" not in data:
            if frame.error is not None:  # an error ends the answer
                yield frame
                return
            continue  # [DONE]: once, at the end
        if not data["choices"] and data.get("usage"):
            usages[index], usage_chunk = data["usage"], data
            continue
        for choice in data["choices"]:
            choice["index"] = index
        yield frame
    if usage_chunk is not None:
        usage = merge_usage([usages[i] for i in sorted(usages)])
        yield Frame({**usage_chunk, "usage": usage})
    yield Frame("[DONE]")


def sse_choices(frames_: Iterator[Frame | KeepAlive]) -> Iterator[bytes]:
    for frame in frames_:
        yield (
            KEEPALIVE_COMMENT if isinstance(frame, KeepAlive) else sse_event(frame.data, frame.name)
        )


def folded_choices(
    encoders: Sequence[EventEncoder],
    streams: Sequence[Iterator[Event]],
    ctxs: Sequence[RequestContext],
    fold: Fold,
    json_frames: Callable[[EventEncoder, Iterator[Event], RequestContext], Iterator[Frame]],
) -> dict[str, Any]:
    """Each choice folded on its own (the engine decodes them together meanwhile), then
    merged: choices in order, the first body's id, usage merged."""
    bodies = [
        fold(json_frames(e, s, c), c) for e, s, c in zip(encoders, streams, ctxs, strict=True)
    ]
    merged = dict(bodies[0])
    merged["choices"] = [{**body["choices"][0], "index": i} for i, body in enumerate(bodies)]
    if all(body.get("usage") for body in bodies):
        merged["usage"] = merge_usage([body["usage"] for body in bodies])
    return merged


def close_all(streams: Sequence[Iterator[Event]]) -> None:
    for stream in streams:
        close_events(stream)


class ChoicesEncoding:
    """`encode_choices_json` / `encode_choices_stream` of a protocol serving `n` (mixed
    into its WireProtocol), from its one-encoder-per-choice factory and its fold."""

    serves_choices: ClassVar[bool] = True

    def choice_encoders(
        self, ctxs: Sequence[RequestContext], folded: bool
    ) -> Sequence[EventEncoder]:
        """One encoder per choice under the first one's id; `folded`: for one JSON body."""
        raise NotImplementedError

    def fold_choice(self, frames_: Iterator[Frame], ctx: RequestContext) -> dict[str, Any]:
        raise NotImplementedError

    def encode_choices_json(
        self, streams: Sequence[Iterator[Event]], ctxs: Sequence[RequestContext]
    ) -> dict[str, Any]:
        try:
            encoders = self.choice_encoders(ctxs, folded=True)
            return folded_choices(encoders, streams, ctxs, self.fold_choice, json_frames)
        finally:
            close_all(streams)

    def encode_choices_stream(
        self, streams: Sequence[Iterator[Event]], ctxs: Sequence[RequestContext]
    ) -> Iterator[bytes]:
        try:
            encoders = self.choice_encoders(ctxs, folded=False)
            yield from sse_choices(choice_frames(encoders, streams, ctxs))
        finally:
            close_all(streams)


__all__ = [
    "ChoicesEncoding",
    "choice_frames",
    "close_all",
    "folded_choices",
    "merge_usage",
    "sse_choices",
]
