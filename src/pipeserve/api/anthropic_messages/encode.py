"""Pipeline events -> Anthropic Messages stream events (as dicts).

This one state machine (`MessageEvents`) drives both encoders: the SSE encoder frames
its events, the JSON encoder folds them as an SDK accumulates a stream (fold.py), so
streamed and non-streamed answers are the same message by construction.

- `message_start` waits for PromptReady so it carries the real input token counts;
  KeepAlive before (or after) it is a `ping`.
- Usage follows Anthropic's accounting (total input = input_tokens +
  cache_read_input_tokens + cache_creation_input_tokens): input_tokens = prompt tokens
  minus the prefix-cache hits, cache_read_input_tokens = the hits, creation = 0.
- Blocks are strictly sequential: a block is stopped before the next starts.
- Tool input is buffered and validated, as Anthropic does without the
  `fine-grained-tool-streaming` beta: a tool_use block is sent when its call is complete
  (content_block_start, one input_json_delta with the final coerced arguments, stop), and
  only if those arguments are a JSON object. A call cut off by max tokens or malformed
  becomes text (its raw arguments) instead, so no client ever sees a tool_use block whose
  input the SDK's partial-JSON parser repaired into a plausible but wrong object; the
  stop_reason then says max_tokens / end_turn (the tool_calls stage only finishes
  "tool_calls" after a valid call). A `ping` every PING_EVERY held fragments keeps the
  connection visibly alive while a long call is buffered.
- Thinking signature: "pssig1_" + urlsafe-base64 SHA-256 of a domain tag and the
  thinking text. It is opaque, non-empty and deterministic (the same text gives the same
  signature in every worker, streamed or not); it proves nothing and is never checked
  when a client sends the block back.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any

from pipeserve.api.anthropic_messages.decode import AnthropicGenerationRequest
from pipeserve.api.framing import KEEPALIVE, EventEncoder, Frame
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError, ErrorKind
from pipeserve.events import (
    ContentDelta,
    ErrorEvent,
    Event,
    Finish,
    KeepAlive,
    PromptReady,
    ReasoningDelta,
    TokenText,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
    arguments_valid,
)

log = logging.getLogger(__name__)

SIGNATURE_TAG = b"pipeserve-thinking-v1\x00"
EMPTY_BLOCKS: dict[str, dict[str, str]] = {
    "thinking": {"type": "thinking", "thinking": "", "signature": ""},
    "text": {"type": "text", "text": ""},
}
PING_EVERY = 64  # held argument fragments between pings
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
# ErrorEvent.kind / ApiError.kind <-> Anthropic error type
ERROR_TYPES: dict[str, str] = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "too_large": "request_too_large",
    "rate_limit": "rate_limit_error",
    "overloaded": "overloaded_error",
    "timeout": "timeout_error",
    "body_timeout": "invalid_request_error",
    "internal": "api_error",
    "unavailable": "api_error",
}
ERROR_KINDS: dict[str, ErrorKind] = {
    "invalid_request_error": "invalid_request",
    "authentication_error": "authentication",
    "permission_error": "permission",
    "not_found_error": "not_found",
    "request_too_large": "too_large",
    "rate_limit_error": "rate_limit",
    "overloaded_error": "overloaded",
    "timeout_error": "timeout",
    "api_error": "internal",
}
_UNSAFE_ID = re.compile(r"[^A-Za-z0-9_-]")


def message_id(ctx: RequestContext) -> str:
    rid = _UNSAFE_ID.sub("", ctx.request_id)
    return rid if rid.startswith("msg_") else f"msg_{rid or 'pipeserve'}"


def tool_use_id(call_id: str) -> str:
    """`toolu_` ids as Anthropic clients expect; the tool stage's id is kept inside."""
    clean = _UNSAFE_ID.sub("_", call_id)
    return clean if clean.startswith("toolu_") else f"toolu_{clean.removeprefix('call_')}"


def error_event(kind: str, message: str) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {"type": ERROR_TYPES.get(kind, "api_error"), "message": message},
    }


class _Signature:
    def __init__(self) -> None:
        self._hash = hashlib.sha256(SIGNATURE_TAG)

    def update(self, text: str) -> None:
        self._hash.update(text.encode())

    def value(self) -> str:
        return "pssig1_" + base64.urlsafe_b64encode(self._hash.digest()).decode().rstrip("=")


class _MessageStream:
    """Per-request state: which block is open, what was sent, the counts for usage."""

    def __init__(self, ctx: RequestContext) -> None:
        self.ctx = ctx
        self.started = False
        self.done = False
        self.failed = False
        self.index = -1  # index of the last started block
        self.open_kind: str | None = None  # "thinking" | "text" | "tool_use" while open
        self.held_tool: ToolCallStart | None = None  # the call being buffered
        self.held_fragments = 0
        self.signature = _Signature()
        request = ctx.request
        self.omit_thinking = (
            isinstance(request, AnthropicGenerationRequest) and request.omit_thinking
        )
        self.show_thinking = (
            not isinstance(request, AnthropicGenerationRequest) or request.show_thinking
        )
        self.prompt_tokens = len(ctx.prompt_token_ids or [])
        self.cached_tokens = 0
        self.finish: Finish | None = None
        self.usage: Usage | None = None

    def handle(self, event: Event) -> Iterator[dict[str, Any]]:
        if isinstance(event, KeepAlive):
            yield {"type": "ping"}
        elif isinstance(event, PromptReady):
            self.prompt_tokens, self.cached_tokens = event.prompt_tokens, event.cached_tokens
            yield from self.start()
        elif isinstance(event, (ContentDelta, TokenText)):
            yield from self.delta("text", event.text)
        elif isinstance(event, ReasoningDelta):
            if self.show_thinking:  # else left out of the answer; usage still counts it
                yield from self.delta("thinking", event.text)
        elif isinstance(event, ToolCallStart):
            yield from self.tool_start(event)
        elif isinstance(event, ToolCallArgsDelta):
            yield from self.tool_args(event.index, event.fragment)
        elif isinstance(event, ToolCallEnd):
            yield from self.tool_end(event)
        elif isinstance(event, Finish):
            yield from self.on_finish(event)
        elif isinstance(event, Usage):
            self.usage = event
            if self.finish is not None:
                yield from self.end()
        elif isinstance(event, ErrorEvent):
            yield from self.fail(event.kind, event.message)

    def start(self) -> Iterator[dict[str, Any]]:
        if self.started:
            return
        self.started = True
        yield {
            "type": "message_start",
            "message": {
                "id": message_id(self.ctx),
                "type": "message",
                "role": "assistant",
                "model": self.ctx.model_name,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": self.start_usage(),
            },
        }

    def usage_dict(self, output_tokens: int) -> dict[str, Any]:
        prompt, cached = self.prompt_tokens, self.cached_tokens
        if self.usage is not None:
            prompt, cached = self.usage.prompt_tokens, self.usage.cached_tokens
        usage: dict[str, Any] = {
            "input_tokens": max(prompt - cached, 0),
            "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
        }
        if self.usage is not None and self.usage.reasoning_tokens:
            usage["output_tokens_details"] = {"thinking_tokens": self.usage.reasoning_tokens}
        return usage

    def start_usage(self) -> dict[str, Any]:
        """message_start's usage also carries the fields only a Message's Usage has (the
        delta usage merges into it: fold.py, the SDKs)."""
        cache_creation = {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0}
        return {
            **self.usage_dict(output_tokens=0),
            "cache_creation": cache_creation,
            "service_tier": "standard",
        }

    def open_block(self, block: dict[str, Any]) -> Iterator[dict[str, Any]]:
        yield from self.start()
        yield from self.close_block()
        self.index += 1
        self.open_kind = block["type"]
        yield {"type": "content_block_start", "index": self.index, "content_block": block}

    def close_block(self) -> Iterator[dict[str, Any]]:
        if self.open_kind is None:
            return
        if self.open_kind == "thinking":
            delta = {"type": "signature_delta", "signature": self.signature.value()}
            yield {"type": "content_block_delta", "index": self.index, "delta": delta}
            self.signature = _Signature()
        yield {"type": "content_block_stop", "index": self.index}
        self.open_kind = None

    def delta(self, kind: str, text: str) -> Iterator[dict[str, Any]]:
        if not text:
            return
        if self.open_kind != kind:
            yield from self.open_block(dict(EMPTY_BLOCKS[kind]))
        if kind == "thinking":
            self.signature.update(text)
            if self.omit_thinking:
                return  # thinking.display "omitted": the block keeps only its signature
            delta = {"type": "thinking_delta", "thinking": text}
        else:
            delta = {"type": "text_delta", "text": text}
        yield {"type": "content_block_delta", "index": self.index, "delta": delta}

    def tool_start(self, event: ToolCallStart) -> Iterator[dict[str, Any]]:
        yield from self.start()
        self.held_tool, self.held_fragments = event, 0

    def tool_args(self, index: int, fragment: str) -> Iterator[dict[str, Any]]:
        if self.held_tool is None or self.held_tool.index != index or not fragment:
            return
        self.held_fragments += 1
        if self.held_fragments % PING_EVERY == 0:
            yield {"type": "ping"}

    def tool_end(self, event: ToolCallEnd) -> Iterator[dict[str, Any]]:
        held, self.held_tool = self.held_tool, None
        if held is None or held.index != event.index:
            return
        final = event.arguments
        if not is_json_object(final):
            log.warning("tool call %d: arguments are not a JSON object: %.200s", event.index, final)
            yield from self.delta("text", final)
            return
        yield from self.open_block(
            {"type": "tool_use", "id": tool_use_id(held.id), "name": held.name, "input": {}}
        )
        if final.strip():
            delta = {"type": "input_json_delta", "partial_json": final}
            yield {"type": "content_block_delta", "index": self.index, "delta": delta}
        yield from self.close_block()

    def on_finish(self, event: Finish) -> Iterator[dict[str, Any]]:
        yield from self.close_block()
        if event.reason == "cancelled":
            self.done = True  # client gone or request aborted: end without message_stop
        elif event.reason == "error":
            yield from self.fail("internal", "generation failed")
        else:
            self.finish = event

    def end(self) -> Iterator[dict[str, Any]]:
        yield from self.start()
        assert self.finish is not None
        stop_sequence = self.finish.stop_sequence
        reason = "stop_sequence" if stop_sequence is not None else STOP_REASONS[self.finish.reason]
        output_tokens = self.usage.completion_tokens if self.usage is not None else 0
        yield {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
            "usage": self.usage_dict(output_tokens),
        }
        yield {"type": "message_stop"}
        self.done = True

    def fail(self, kind: str, message: str) -> Iterator[dict[str, Any]]:
        self.done = self.failed = True
        yield error_event(kind, message)

    def close(self) -> Iterator[dict[str, Any]]:
        """The event stream ended: finish normally if Finish came without Usage."""
        if self.done:
            return
        if self.finish is not None:
            yield from self.end()
        else:
            yield from self.fail("internal", "generation ended without a finish reason")


is_json_object = arguments_valid  # no arguments at all counts: input stays {}


class MessageEvents(EventEncoder):
    """The Messages stream events of one request, as frames for the shared base
    (api/framing.py), which also drains the pipeline after the last one."""

    def __init__(self, ctx: RequestContext) -> None:
        self.state = _MessageStream(ctx)

    @property
    def done(self) -> bool:
        return self.state.done

    @property
    def failed(self) -> bool:
        return self.state.failed

    def feed(self, event: Event) -> list[Frame]:
        return _frames(self.state.handle(event))

    def keepalive(self) -> list[Frame]:
        return _frames(self.state.handle(KEEPALIVE))

    def close(self) -> list[Frame]:
        return _frames(self.state.close())

    def error(self, err: ApiError) -> list[Frame]:
        return _frames(self.state.fail(err.kind, err.message))


def _frames(events: Iterable[dict[str, Any]]) -> list[Frame]:
    return [Frame(event, event["type"]) for event in events]
