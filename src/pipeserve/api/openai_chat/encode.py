"""The Chat Completions events: `chat.completion.chunk`s, produced once per request
(ChatEvents). The SSE stream frames them (api/framing.py); the `chat.completion` body is
their fold (fold.py), so both say the same by construction.

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

from dataclasses import dataclass
from typing import Any

from pipeserve.api.framing import EventEncoder, Frame
from pipeserve.api.openai_common import (
    LogprobCursor,
    api_error_from_event,
    cancelled_error,
    chat_usage,
    new_id,
    now,
    openai_error_body,
)
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError
from pipeserve.events import (
    ContentDelta,
    ErrorEvent,
    Event,
    Finish,
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


def _finish_reason(event: Finish, calls: dict[int, _Call], ctx: RequestContext) -> str:
    if event.reason == "cancelled":
        raise cancelled_error(ctx)
    if event.reason == "error":
        raise ApiError("internal", "generation failed")
    if event.reason == "stop" and any(call.valid for call in calls.values()):
        return "tool_calls"
    return FINISH[event.reason]


class ChatEvents(EventEncoder):
    """Turns pipeline events into `chat.completion.chunk`s (one instance per request).

    The usage chunk is sent when the client asked for it (`include_usage`); the fold
    always asks for it.
    """

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
    ) -> list[Frame]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if logprobs:
            choice["logprobs"] = {"content": logprobs, "refusal": None}
        return [Frame(self._base([choice]))]

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

    def open(self) -> list[Frame]:
        return self.chunk({"role": "assistant", "content": "", "refusal": None})

    def error(self, err: ApiError) -> list[Frame]:
        return [Frame(openai_error_body(err), error=err)]

    def close(self) -> list[Frame]:
        usage = [Frame({**self._base([]), "usage": chat_usage(self.usage)})]
        return (usage if self.include_usage else []) + [Frame("[DONE]")]

    def feed(self, event: Event) -> list[Frame]:
        if isinstance(event, (ContentDelta, TokenText)):
            direct = event if isinstance(event, TokenText) else None
            logprobs = self.cursor.take(direct)
            return self.chunk({"content": event.text}, logprobs=logprobs) if event.text else []
        if isinstance(event, ReasoningDelta):
            self.cursor.skip()
            return self.chunk({"reasoning_content": event.text}) if event.text else []
        if isinstance(event, (ToolCallStart, ToolCallArgsDelta, ToolCallEnd)):
            return self.tool_chunk(event)
        if isinstance(event, Finish):
            return self.chunk({}, _finish_reason(event, self.calls, self.ctx))
        if isinstance(event, Usage):
            self.usage = event
        elif isinstance(event, ErrorEvent):
            raise api_error_from_event(event)
        return []

    def tool_chunk(self, event: ToolCallStart | ToolCallArgsDelta | ToolCallEnd) -> list[Frame]:
        if isinstance(event, ToolCallStart):
            self.cursor.skip()
            call = self.calls[event.index] = _Call(event.id or new_id("call_"), event.name)
            fn = {"name": call.name, "arguments": ""}
            head = {"index": event.index, "id": call.id, "type": "function", "function": fn}
            return self.chunk({"tool_calls": [head]})
        existing = self.calls.get(event.index)
        if existing is None:
            return []
        if isinstance(event, ToolCallEnd):
            existing.arguments = event.arguments
        if isinstance(event, ToolCallArgsDelta):
            fragment = event.fragment
        elif event.arguments.startswith(existing.streamed):
            fragment = event.arguments[len(existing.streamed) :]  # text never streamed
        else:
            return []  # coerced arguments differ from the streamed ones: cannot retract
        existing.streamed += fragment
        if not fragment:
            return []
        return self.chunk(
            {"tool_calls": [{"index": event.index, "function": {"arguments": fragment}}]}
        )


__all__ = ["SERVICE_TIER", "SYSTEM_FINGERPRINT", "ChatEvents"]
