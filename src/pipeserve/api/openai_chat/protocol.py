"""The registered OpenAI Chat Completions protocol (`api: openai-chat`, conventionally
/v1/chat/completions): decode (decode.py), encode as SSE or as one `chat.completion`
(encode.py, fold.py, on the shared base api/framing.py) and OpenAI error bodies."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from pipeserve.api.base import RequestMeta, WireProtocol, register_protocol
from pipeserve.api.choices import ChoicesEncoding
from pipeserve.api.framing import Frame, json_frames, sse_frames
from pipeserve.api.openai_chat.decode import ChatGenerationRequest, decode_chat
from pipeserve.api.openai_chat.encode import ChatEvents
from pipeserve.api.openai_chat.fold import fold_completion
from pipeserve.api.openai_common import close_events, openai_error_body
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError
from pipeserve.events import Event
from pipeserve.request import GenerationRequest


@register_protocol
class OpenAIChat(ChoicesEncoding, WireProtocol):
    name = "openai-chat"

    def decode(self, body: Any, meta: RequestMeta) -> GenerationRequest:
        return decode_chat(body)

    def encode_json(self, events: Iterator[Event], ctx: RequestContext) -> dict[str, Any]:
        try:
            chunks = json_frames(ChatEvents(ctx, include_usage=True), events, ctx)
            return fold_completion(chunks, ctx)
        finally:
            close_events(events)

    def encode_stream(self, events: Iterator[Event], ctx: RequestContext) -> Iterator[bytes]:
        try:
            yield from sse_frames(ChatEvents(ctx, include_usage=wants_usage(ctx)), events, ctx)
        finally:
            close_events(events)

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return openai_error_body(error)

    def choice_encoders(self, ctxs: Sequence[RequestContext], folded: bool) -> list[ChatEvents]:
        """One encoder per choice, all under the first one's id."""
        encoders = [ChatEvents(ctx, include_usage=folded or wants_usage(ctx)) for ctx in ctxs]
        for encoder in encoders[1:]:
            encoder.id, encoder.created = encoders[0].id, encoders[0].created
        return encoders

    def fold_choice(self, frames: Iterator[Frame], ctx: RequestContext) -> dict[str, Any]:
        return fold_completion(frames, ctx)


def wants_usage(ctx: RequestContext) -> bool:
    """A streamed answer ends with a usage chunk only when stream_options asks."""
    request = ctx.request
    return isinstance(request, ChatGenerationRequest) and request.include_usage


__all__ = ["OpenAIChat"]
