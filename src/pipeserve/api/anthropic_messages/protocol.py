"""The registered Anthropic Messages protocol (`/v1/messages`, `/v1/messages/count_tokens`).

Decoding lives in decode.py (+ schema.py), the event -> stream-event state machine in
encode.py and the fold of stream events into the non-streaming message in fold.py; this
module wires them to the shared base (api/framing.py) and renders error bodies.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, ClassVar

from pipeserve.api.anthropic_messages.decode import decode_body
from pipeserve.api.anthropic_messages.encode import ERROR_TYPES, MessageEvents
from pipeserve.api.anthropic_messages.fold import fold_message
from pipeserve.api.base import RequestMeta, WireProtocol, context_overflow, register_protocol
from pipeserve.api.framing import close_events, json_frames, sse_frames
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError
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


__all__ = ["AnthropicMessages"]
