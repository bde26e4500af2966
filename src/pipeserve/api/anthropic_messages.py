"""Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`).

Decoding lives in anthropic_decode (+ anthropic_schema), encoding in anthropic_encode;
this module is the registered WireProtocol that ties them together.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

from pipeserve.api.anthropic_decode import decode_body
from pipeserve.api.anthropic_encode import ERROR_TYPES, fold_message, message_events
from pipeserve.api.base import RequestMeta, WireProtocol, register_protocol
from pipeserve.api.sse import sse_event
from pipeserve.errors import ApiError
from pipeserve.events import Event
from pipeserve.request import GenerationRequest
from pipeserve.stages.base import RequestContext


@register_protocol
class AnthropicMessages(WireProtocol):
    name: ClassVar[str] = "anthropic-messages"
    overload_status: ClassVar[int] = 529

    def decode(self, body: Any, meta: RequestMeta) -> GenerationRequest:
        return decode_body(body)

    def count_tokens_body(self, body: Any, meta: RequestMeta) -> GenerationRequest:
        """Same rules as decode, but max_tokens is optional (count_tokens has none)."""
        return decode_body(body, count_tokens=True)

    def count_tokens_response(self, input_tokens: int) -> dict[str, Any]:
        return {"input_tokens": input_tokens}

    def encode_json(self, events: Iterator[Event], ctx: RequestContext) -> dict[str, Any]:
        return fold_message(message_events(events, ctx), ctx)

    def encode_stream(self, events: Iterator[Event], ctx: RequestContext) -> Iterator[bytes]:
        for event in message_events(events, ctx):
            yield sse_event(event, event["type"])

    def error_body(self, error: ApiError) -> dict[str, Any]:
        kind = ERROR_TYPES.get(error.kind, "api_error")
        return {"type": "error", "error": {"type": kind, "message": error.message}}


__all__ = ["AnthropicMessages"]
