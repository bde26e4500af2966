"""Encoders for Chat Completions: `chat.completion` bodies and `chat.completion.chunk` SSE.

Reasoning goes out as `reasoning_content`; tool calls stream as `tool_calls` deltas
whose first fragment carries index/id/type/name and later ones argument text only.
A failure mid-stream is a `data: {"error": ...}` frame (the openai SDK raises APIError
on it) and no `[DONE]`.

Broken calls follow OpenAI: a call cut off by max tokens keeps its partial arguments and
the finish reason `length`; a call whose arguments are not a JSON object (malformed) is
still listed as written, but "stop" becomes `tool_calls` only when some call ended with
valid JSON-object arguments, so a client never reads `tool_calls` for a turn whose calls
cannot be run. Argument fragments are streamed as generated (no hold-back).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pipeserve.api.openai_common import (
    KEEPALIVE_FRAME,
    LogprobCursor,
    api_error_from_event,
    cancelled_error,
    chat_usage,
    new_id,
    now,
    openai_error_body,
)
from pipeserve.api.sse import sse_event
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError
from pipeserve.events import (
    ContentDelta,
    ErrorEvent,
    Event,
    Finish,
    KeepAlive,
    ReasoningDelta,
    TokenText,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
    arguments_valid,
)

FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls"}
# Fields OpenAI sends on every completion and chunk: the tier that served the request
# and the backend configuration tag (one serving stack here, so one constant).
SERVICE_TIER = "default"
SYSTEM_FINGERPRINT = "fp_pipeserve"


@dataclass
class _Call:
    id: str
    name: str
    streamed: str = ""
    arguments: str | None = None

    @property
    def valid(self) -> bool:
        return self.arguments is not None and arguments_valid(self.arguments)


@dataclass
class Accumulated:
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, _Call] = field(default_factory=dict)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish: str = "stop"
    usage: Usage = field(default_factory=lambda: Usage(0, 0))


def _finish_reason(event: Finish, calls: dict[int, _Call], ctx: RequestContext) -> str:
    if event.reason == "cancelled":
        raise cancelled_error(ctx)
    if event.reason == "error":
        raise ApiError("internal", "generation failed")
    if event.reason == "stop" and any(call.valid for call in calls.values()):
        return "tool_calls"
    return FINISH[event.reason]


def accumulate(events: Iterator[Event], ctx: RequestContext) -> Accumulated:
    acc, cursor = Accumulated(), LogprobCursor(ctx)
    for event in events:
        if isinstance(event, (ContentDelta, TokenText)):
            acc.content.append(event.text)
            acc.logprobs += cursor.take(event if isinstance(event, TokenText) else None)
        elif isinstance(event, ReasoningDelta):
            acc.reasoning.append(event.text)
            cursor.skip()
        elif isinstance(event, ToolCallStart):
            acc.calls[event.index] = _Call(event.id or new_id("call_"), event.name)
            cursor.skip()
        elif isinstance(event, ToolCallArgsDelta) and event.index in acc.calls:
            acc.calls[event.index].streamed += event.fragment
        elif isinstance(event, ToolCallEnd) and event.index in acc.calls:
            acc.calls[event.index].arguments = event.arguments
        elif isinstance(event, Finish):
            acc.finish = _finish_reason(event, acc.calls, ctx)
        elif isinstance(event, Usage):
            acc.usage = event
        elif isinstance(event, ErrorEvent):
            raise api_error_from_event(event)
    return acc


class ChatStreamEncoder:
    """Turns events into `chat.completion.chunk` SSE frames (one instance per request)."""

    def __init__(self, ctx: RequestContext, include_usage: bool = False) -> None:
        self.ctx = ctx
        self.id = new_id("chatcmpl-")
        self.created = now()
        self.include_usage = include_usage
        self.cursor = LogprobCursor(ctx)
        self.calls: dict[int, _Call] = {}
        self.usage = Usage(0, 0)

    def chunk(
        self,
        delta: dict[str, Any],
        finish: str | None = None,
        logprobs: list[dict[str, Any]] | None = None,
    ) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if logprobs:
            choice["logprobs"] = {"content": logprobs, "refusal": None}
        return sse_event(self._base([choice]))

    def _base(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.ctx.model_name,
            "service_tier": SERVICE_TIER,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = None
        return body

    def error(self, err: ApiError) -> bytes:
        return sse_event(openai_error_body(err))

    def run(self, events: Iterator[Event]) -> Iterator[bytes]:
        yield self.chunk({"role": "assistant", "content": "", "refusal": None})
        for event in events:
            try:
                frame = self.frame(event)
            except ApiError as err:
                yield self.error(err)
                return
            if frame:
                yield frame
        if self.include_usage:
            yield sse_event({**self._base([]), "usage": chat_usage(self.usage)})
        yield sse_event("[DONE]")

    def frame(self, event: Event) -> bytes | None:
        if isinstance(event, (ContentDelta, TokenText)):
            direct = event if isinstance(event, TokenText) else None
            logprobs = self.cursor.take(direct)
            return self.chunk({"content": event.text}, logprobs=logprobs) if event.text else None
        if isinstance(event, ReasoningDelta):
            self.cursor.skip()
            return self.chunk({"reasoning_content": event.text}) if event.text else None
        if isinstance(event, (ToolCallStart, ToolCallArgsDelta, ToolCallEnd)):
            return self.tool_frame(event)
        if isinstance(event, Finish):
            return self.chunk({}, _finish_reason(event, self.calls, self.ctx))
        if isinstance(event, Usage):
            self.usage = event
        elif isinstance(event, ErrorEvent):
            raise api_error_from_event(event)
        elif isinstance(event, KeepAlive):
            return KEEPALIVE_FRAME
        return None

    def tool_frame(self, event: ToolCallStart | ToolCallArgsDelta | ToolCallEnd) -> bytes | None:
        if isinstance(event, ToolCallStart):
            self.cursor.skip()
            call = self.calls[event.index] = _Call(event.id or new_id("call_"), event.name)
            fn = {"name": call.name, "arguments": ""}
            return self.chunk(
                {
                    "tool_calls": [
                        {"index": event.index, "id": call.id, "type": "function", "function": fn}
                    ]
                }
            )
        existing = self.calls.get(event.index)
        if existing is None:
            return None
        if isinstance(event, ToolCallEnd):
            existing.arguments = event.arguments
        if isinstance(event, ToolCallArgsDelta):
            fragment = event.fragment
        elif event.arguments.startswith(existing.streamed):
            fragment = event.arguments[len(existing.streamed) :]  # text never streamed
        else:
            return None  # coerced arguments differ from the streamed ones: cannot retract
        existing.streamed += fragment
        if not fragment:
            return None
        return self.chunk(
            {"tool_calls": [{"index": event.index, "function": {"arguments": fragment}}]}
        )


def completion_body(acc: Accumulated, ctx: RequestContext) -> dict[str, Any]:
    content = "".join(acc.content)
    calls = [acc.calls[i] for i in sorted(acc.calls)]
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content,
        "refusal": None,
        "annotations": [],
    }
    if calls:
        message["content"] = content if content.strip() else None
        message["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {
                    "name": c.name,
                    "arguments": c.streamed if c.arguments is None else c.arguments,
                },
            }
            for c in calls
        ]
    if acc.reasoning:
        message["reasoning_content"] = "".join(acc.reasoning)
    logprobs = {"content": acc.logprobs, "refusal": None} if ctx.request.logprobs else None
    return {
        "id": new_id("chatcmpl-"),
        "object": "chat.completion",
        "created": now(),
        "model": ctx.model_name,
        "service_tier": SERVICE_TIER,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": [
            {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": acc.finish}
        ],
        "usage": chat_usage(acc.usage),
    }


__all__ = ["ChatStreamEncoder", "accumulate", "completion_body"]
