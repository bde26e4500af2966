"""Builds Responses output items and stream events from pipeline events (ResponsesBuilder),
and hands them to the shared base (api/framing.py) as one EventEncoder (ResponseEvents).

Items are strictly sequential: opening an item (reasoning, message, function_call)
closes the open one with its `.done` events. Every stream event carries a
`sequence_number` (from 0); item events carry `output_index`, content events
`content_index`. The final `response.completed` / `response.incomplete` needs Usage,
which arrives after Finish, so it is produced by `final()` once the events end.

With `reasoning.summary` asked, reasoning is sent as the item's `summary` (one
summary_text part, `response.reasoning_summary_*` events), as the clients that show
Responses reasoning (Vercel AI SDK, LangChain, Codex) read it; otherwise as `content`
(reasoning_text parts, `response.reasoning_text.*` events).

Broken calls: arguments stream as generated; a function_call whose final arguments are not
a JSON object (cut off by max tokens, or malformed) ends with item status `incomplete`,
and a cut-off turn ends with `response.incomplete` (as OpenAI does for max_output_tokens).
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeserve.api.framing import EventEncoder, Frame
from pipeserve.api.openai_common import (
    KEEPALIVE_FRAME,
    LogprobCursor,
    api_error_from_event,
    cancelled_error,
    new_id,
    now,
    responses_usage,
    split_namespace,
)
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

Built = dict[str, Any] | bytes  # a builder's event (bytes: a keep-alive frame)
SEALED_REASONING = "reasoning.encrypted_content"
_SEAL_PREFIX = "pipeserve.v1:"


def seal_reasoning(text: str) -> str:
    """Our `encrypted_content`: the reasoning text itself (we keep no secrets, only state).

    Stateless clients (Codex: store false) send reasoning items back with it, so the next
    turn's prompt can carry the reasoning even when the item's content is dropped.
    """
    return _SEAL_PREFIX + base64.b64encode(text.encode()).decode("ascii")


def open_reasoning(blob: object) -> str | None:
    """The text of a blob we sealed; None for anything else (e.g. real OpenAI blobs)."""
    if not isinstance(blob, str) or not blob.startswith(_SEAL_PREFIX):
        return None
    try:
        return base64.b64decode(blob[len(_SEAL_PREFIX) :], validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        return None


@dataclass
class _Open:
    """The item being generated: its output index, item dict and accumulated text."""

    index: int
    item: dict[str, Any]
    parts: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    call_index: int | None = None  # ToolCallStart.index for function calls


class ResponsesBuilder:
    def __init__(self, ctx: RequestContext, echo: dict[str, Any] | None = None) -> None:
        self.ctx = ctx
        self.id = new_id("resp_")
        self.created_at = now()
        self.echo: dict[str, Any] = dict(echo or {})  # request fields the Response repeats
        self.seal = SEALED_REASONING in self.echo.get("include", ())
        # reasoning.summary asked: reasoning is sent as its summary (what most clients read)
        self.summarize = bool((self.echo.get("reasoning") or {}).get("summary"))
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: _Open | None = None
        self.cursor = LogprobCursor(ctx)
        self.finish: Finish | None = None
        self.usage = Usage(0, 0)

    # ------------------------------------------------------------ envelope

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return body

    def response(self, status: str, **extra: Any) -> dict[str, Any]:
        echo = self.echo
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "model": self.ctx.model_name,
            "output": copy.deepcopy(self.output),
            "usage": None,
            "instructions": echo.get("instructions"),
            "tools": echo.get("tools", []),
            "tool_choice": echo.get("tool_choice", "auto"),
            "parallel_tool_calls": echo.get("parallel_tool_calls", True),
            "temperature": echo.get("temperature", 1.0),
            "top_p": echo.get("top_p", 1.0),
            "top_logprobs": echo.get("top_logprobs", 0),
            "max_output_tokens": echo.get("max_output_tokens"),
            "reasoning": echo.get("reasoning", {"effort": None, "summary": None}),
            "text": echo.get("text", {"format": {"type": "text"}, "verbosity": "medium"}),
            "metadata": echo.get("metadata", {}),
            "truncation": echo.get("truncation", "disabled"),
            "max_tool_calls": echo.get("max_tool_calls"),
            "store": echo.get("store", False),
            "background": False,
            "previous_response_id": echo.get("previous_response_id"),
            "conversation": None,
            "prompt": None,
            "prompt_cache_key": echo.get("prompt_cache_key"),
            "prompt_cache_retention": echo.get("prompt_cache_retention"),
            "safety_identifier": echo.get("safety_identifier"),
            "service_tier": "default",
            "user": echo.get("user"),
            "completed_at": None,
            **extra,
        }

    def start(self) -> list[Built]:
        return [
            self.event("response.created", response=self.response("in_progress")),
            self.event("response.in_progress", response=self.response("in_progress")),
        ]

    def final(self) -> list[Built]:
        """The closing stream events; the last one's `response` is the non-streaming body."""
        if self.finish is None:
            raise ApiError("internal", "generation ended without a finish")
        frames = self.close_open()  # normally already closed on Finish
        usage = responses_usage(self.usage)
        if self.finish.reason == "length":
            details = {"reason": "max_output_tokens"}
            body = self.response("incomplete", usage=usage, incomplete_details=details)
            return [*frames, self.event("response.incomplete", response=body)]
        body = self.response("completed", usage=usage, completed_at=now())
        return [*frames, self.event("response.completed", response=body)]

    def failed(self, err: ApiError) -> dict[str, Any]:
        if self.open is not None:
            self.output.append({**self.snapshot(self.open), "status": "incomplete"})
            self.open = None
        code = "rate_limit_exceeded" if err.kind in ("rate_limit", "overloaded") else "server_error"
        body = self.response("failed", error={"code": code, "message": err.message})
        return self.event("response.failed", response=body)

    # ------------------------------------------------------------ events

    def feed(self, event: Event) -> list[Built]:
        if isinstance(event, (ContentDelta, TokenText)):
            direct = event if isinstance(event, TokenText) else None
            return self.text("message", event.text, self.cursor.take(direct)) if event.text else []
        if isinstance(event, ReasoningDelta):
            self.cursor.skip()
            return self.text("reasoning", event.text, []) if event.text else []
        if isinstance(event, ToolCallStart):
            self.cursor.skip()
            return self.call_start(event)
        if isinstance(event, ToolCallArgsDelta):
            return self.call_delta(event.index, event.fragment)
        if isinstance(event, ToolCallEnd):
            return self.call_end(event)
        if isinstance(event, Finish):
            return self.on_finish(event)
        if isinstance(event, Usage):
            self.usage = event
        elif isinstance(event, ErrorEvent):
            raise api_error_from_event(event)
        elif isinstance(event, KeepAlive):
            return [KEEPALIVE_FRAME]
        return []

    def on_finish(self, event: Finish) -> list[Built]:
        if event.reason == "cancelled":
            raise cancelled_error(self.ctx)
        if event.reason == "error":
            raise ApiError("internal", "generation failed")
        self.finish = event
        frames: list[Built] = []
        if not self.output and self.open is None:  # nothing generated: still answer with a message
            frames += self.open_text_item("message")
        return frames + self.close_open(incomplete=event.reason == "length")

    def text(self, kind: str, delta: str, logprobs: list[dict[str, Any]]) -> list[Built]:
        frames: list[Built] = []
        if self.open is None or self.open.item["type"] != kind:
            frames += self.close_open()
            frames += self.open_text_item(kind)
        assert self.open is not None
        self.open.parts.append(delta)
        self.open.logprobs += logprobs
        ids = {"item_id": self.open.item["id"], "output_index": self.open.index, "content_index": 0}
        if kind == "message":
            frames.append(
                self.event("response.output_text.delta", **ids, delta=delta, logprobs=logprobs)
            )
        elif self.summarize:
            ids = {**ids, "summary_index": ids.pop("content_index")}
            frames.append(self.event("response.reasoning_summary_text.delta", **ids, delta=delta))
        else:
            frames.append(self.event("response.reasoning_text.delta", **ids, delta=delta))
        return frames

    def open_text_item(self, kind: str) -> list[Built]:
        if kind == "message":
            item = {
                "id": new_id("msg_"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            part: dict[str, Any] = {
                "type": "output_text",
                "text": "",
                "annotations": [],
                "logprobs": [],
            }
        else:
            item = {"id": new_id("rs_"), "type": "reasoning", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self.open = _Open(len(self.output), item)
        added = self.event(
            "response.output_item.added", output_index=self.open.index, item=copy.deepcopy(item)
        )
        ids = {"item_id": item["id"], "output_index": self.open.index}
        if kind == "reasoning" and self.summarize:
            part = {"type": "summary_text", "text": ""}
            kind_added = "response.reasoning_summary_part.added"
            return [added, self.event(kind_added, **ids, summary_index=0, part=part)]
        return [added, self.event("response.content_part.added", **ids, content_index=0, part=part)]

    def call_start(self, event: ToolCallStart) -> list[Built]:
        frames = self.close_open()
        namespace, name = split_namespace(event.name)
        item: dict[str, Any] = {
            "id": new_id("fc_"),
            "type": "function_call",
            "call_id": event.id or new_id("call_"),
            "name": name,
            "arguments": "",
            "status": "in_progress",
        }
        if namespace:
            item["namespace"] = namespace
        self.open = _Open(len(self.output), item, call_index=event.index)
        frames.append(
            self.event(
                "response.output_item.added", output_index=self.open.index, item=copy.deepcopy(item)
            )
        )
        return frames

    def call_delta(self, call_index: int, fragment: str) -> list[Built]:
        if self.open is None or self.open.call_index != call_index or not fragment:
            return []
        self.open.parts.append(fragment)
        ids = {"item_id": self.open.item["id"], "output_index": self.open.index}
        return [self.event("response.function_call_arguments.delta", **ids, delta=fragment)]

    def call_end(self, event: ToolCallEnd) -> list[Built]:
        if self.open is None or self.open.call_index != event.index:
            return []
        streamed = "".join(self.open.parts)
        frames: list[Built] = []
        if event.arguments.startswith(streamed):
            frames += self.call_delta(event.index, event.arguments[len(streamed) :])
        self.open.item["arguments"] = event.arguments  # the coerced arguments are final
        return frames + self.close_open(incomplete=not arguments_valid(event.arguments))

    # ------------------------------------------------------------ closing items

    def snapshot(self, open_item: _Open, status: str = "completed") -> dict[str, Any]:
        item, text = dict(open_item.item), "".join(open_item.parts)
        if item["type"] == "message":
            item["content"] = [self.output_text(text, open_item.logprobs)]
            item["status"] = status
        elif item["type"] == "reasoning" and self.summarize:
            item["summary"] = [{"type": "summary_text", "text": text}]
            item.pop("content", None)
            if self.seal:
                item["encrypted_content"] = seal_reasoning(text)
        elif item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            if self.seal:
                item["encrypted_content"] = seal_reasoning(text)
        else:
            item["arguments"] = item["arguments"] or text
            item["status"] = status
        return item

    @staticmethod
    def output_text(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    def close_open(self, incomplete: bool = False) -> list[Built]:
        current, self.open = self.open, None
        if current is None:
            return []
        item = self.snapshot(current, "incomplete" if incomplete else "completed")
        self.output.append(item)
        frames: list[Built] = []
        ids = {"item_id": item["id"], "output_index": current.index}
        if item["type"] == "message":
            part = item["content"][0]
            frames.append(
                self.event(
                    "response.output_text.done",
                    **ids,
                    content_index=0,
                    text=part["text"],
                    logprobs=part["logprobs"],
                )
            )
            frames.append(
                self.event("response.content_part.done", **ids, content_index=0, part=part)
            )
        elif item["type"] == "reasoning" and self.summarize:
            part = item["summary"][0]
            done = {**ids, "summary_index": 0}
            frames.append(
                self.event("response.reasoning_summary_text.done", **done, text=part["text"])
            )
            frames.append(self.event("response.reasoning_summary_part.done", **done, part=part))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            frames.append(
                self.event(
                    "response.reasoning_text.done", **ids, content_index=0, text=part["text"]
                )
            )
            frames.append(
                self.event("response.content_part.done", **ids, content_index=0, part=part)
            )
        else:
            frames.append(
                self.event(
                    "response.function_call_arguments.done",
                    **ids,
                    arguments=item["arguments"],
                    name=item["name"],
                )
            )
        frames.append(
            self.event(
                "response.output_item.done", output_index=current.index, item=copy.deepcopy(item)
            )
        )
        return frames


class ResponseEvents(EventEncoder):
    """The Responses stream events of one request (ResponsesBuilder's), for the shared
    base (api/framing.py). The finished response is stored before its last event."""

    def __init__(
        self,
        ctx: RequestContext,
        echo: dict[str, Any],
        keep: Callable[[RequestContext, dict[str, Any]], None],
    ) -> None:
        self.ctx = ctx
        self.builder = ResponsesBuilder(ctx, echo)
        self.keep = keep

    def open(self) -> list[Frame]:
        return _wire(self.builder.start())

    def feed(self, event: Event) -> list[Frame]:
        return _wire(self.builder.feed(event))

    def close(self) -> list[Frame]:
        try:
            final = self.builder.final()
        except ApiError as err:
            return self.error(err)
        last = final[-1]
        if isinstance(last, dict):
            self.keep(self.ctx, last["response"])
        return _wire(final)

    def error(self, err: ApiError) -> list[Frame]:
        failed = self.builder.failed(err)
        return [Frame(failed, failed["type"], error=err)]


def _wire(events: list[Built]) -> list[Frame]:
    return [Frame(event, event["type"]) for event in events if isinstance(event, dict)]


__all__ = [
    "SEALED_REASONING",
    "ResponseEvents",
    "ResponsesBuilder",
    "open_reasoning",
    "seal_reasoning",
]
