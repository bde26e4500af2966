"""Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`).

Decoding lives in anthropic_decode (+ anthropic_schema), the event -> stream-event state
machine in anthropic_encode; this module is the registered WireProtocol: SSE framing,
the fold of stream events into the non-streaming message, and error bodies.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

from pipeserve.api.anthropic_decode import decode_body
from pipeserve.api.anthropic_encode import ERROR_KINDS, ERROR_TYPES, MessageEvents
from pipeserve.api.base import RequestMeta, WireProtocol, context_overflow, register_protocol
from pipeserve.api.framing import close_events, json_frames, sse_frames
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError, ErrorKind
from pipeserve.events import Event
from pipeserve.request import GenerationRequest

log = logging.getLogger(__name__)


@register_protocol
class AnthropicMessages(WireProtocol):
    name: ClassVar[str] = "anthropic-messages"
    overload_status: ClassVar[int] = 529
    client_header: ClassVar[str | None] = "anthropic-version"
    counts_tokens: ClassVar[bool] = True

    def decode(self, body: Any, meta: RequestMeta) -> GenerationRequest:
        return decode_body(body)

    def count_tokens_body(self, body: Any, meta: RequestMeta) -> GenerationRequest:
        """Same rules as decode, but max_tokens is optional (count_tokens has none)."""
        return decode_body(body, count_tokens=True)

    def count_tokens_response(self, input_tokens: int) -> dict[str, Any]:
        return {"input_tokens": input_tokens}

    def encode_json(self, events: Iterator[Event], ctx: RequestContext) -> dict[str, Any]:
        try:
            frames = json_frames(MessageEvents(ctx), events, ctx)
            return fold_message(
                (frame.data for frame in frames if isinstance(frame.data, dict)), ctx
            )
        finally:
            close_events(events)

    def encode_stream(self, events: Iterator[Event], ctx: RequestContext) -> Iterator[bytes]:
        try:
            yield from sse_frames(MessageEvents(ctx), events, ctx)
        finally:
            close_events(events)

    def error_body(self, error: ApiError) -> dict[str, Any]:
        kind = ERROR_TYPES.get(error.kind, "api_error")
        message = error.message
        if (overflow := context_overflow(error)) is not None:
            message = (
                f"prompt is too long: {overflow[0]} tokens > {overflow[1]} maximum ({message})"
            )
        return {"type": "error", "error": {"type": kind, "message": message}}


def fold_message(stream: Iterable[dict[str, Any]], ctx: RequestContext) -> dict[str, Any]:
    """Accumulate stream events into the final message, as the SDKs do."""
    message: dict[str, Any] | None = None
    json_bufs: dict[int, str] = {}
    for event in stream:
        kind = event["type"]
        if kind == "error":
            error = event["error"]
            raise ApiError(ERROR_KINDS.get(error["type"], "internal"), error["message"])
        if kind == "message_start":
            message = dict(event["message"], content=[])
        elif message is None:
            continue  # pings before message_start
        elif kind == "content_block_start":
            message["content"].append(dict(event["content_block"]))
        elif kind == "content_block_delta":
            apply_delta(
                message["content"][event["index"]], event["delta"], json_bufs, event["index"]
            )
        elif kind == "content_block_stop" and event["index"] in json_bufs:
            message["content"][event["index"]]["input"] = parse_input(json_bufs.pop(event["index"]))
        elif kind == "message_delta":
            message.update(event["delta"])
            message["usage"] = {**message["usage"], **event["usage"]}
        elif kind == "message_stop":
            return message
    reason = ctx.cancel_reason or "cancelled"
    error_kind: ErrorKind = "timeout" if reason == "timeout" else "internal"
    raise ApiError(error_kind, f"generation was cancelled ({reason})")


def apply_delta(
    block: dict[str, Any], delta: dict[str, Any], json_bufs: dict[int, str], index: int
) -> None:
    kind = delta["type"]
    if kind == "text_delta":
        block["text"] += delta["text"]
    elif kind == "thinking_delta":
        block["thinking"] += delta["thinking"]
    elif kind == "signature_delta":
        block["signature"] = delta["signature"]
    elif kind == "input_json_delta":
        json_bufs[index] = json_bufs.get(index, "") + delta["partial_json"]


def parse_input(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        log.warning("tool call arguments are not valid JSON: %.200s", text)
        return {}
    return value if isinstance(value, dict) else {}


__all__ = ["AnthropicMessages", "fold_message"]
