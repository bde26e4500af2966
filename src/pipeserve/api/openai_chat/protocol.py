"""The registered OpenAI Chat Completions protocol (`api: openai-chat`, conventionally
/v1/chat/completions): decode (decode.py), encode as SSE or as one `chat.completion`
(encode.py, fold.py, on the shared base api/framing.py) and OpenAI error bodies."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from pipeserve.api.base import RequestMeta, WireProtocol, register_protocol
from pipeserve.api.choices import choice_frames, close_all, folded_choices, sse_choices
from pipeserve.api.framing import json_frames, sse_frames
from pipeserve.api.openai_chat.decode import ChatGenerationRequest, decode_chat
from pipeserve.api.openai_chat.encode import ChatEvents
from pipeserve.api.openai_chat.fold import fold_completion
from pipeserve.api.openai_common import close_events, openai_error_body
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError
from pipeserve.events import Event
from pipeserve.request import GenerationRequest


@register_protocol
class OpenAIChat(WireProtocol):
    name = "openai-chat"
    serves_choices = True

    def decode(self, body: Any, meta: RequestMeta) -> GenerationRequest:
        return decode_chat(body)

    def encode_json(self, events: Iterator[Event], ctx: RequestContext) -> dict[str, Any]:
        try:
            chunks = json_frames(ChatEvents(ctx, include_usage=True), events, ctx)
            return fold_completion(chunks, ctx)
        finally:
            close_events(events)

    def encode_stream(self, events: Iterator[Event], ctx: RequestContext) -> Iterator[bytes]:
        request = ctx.request
        usage = isinstance(request, ChatGenerationRequest) and request.include_usage
        try:
            yield from sse_frames(ChatEvents(ctx, include_usage=usage), events, ctx)
        finally:
            close_events(events)

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return openai_error_body(error)

    def encode_choices_json(
        self, streams: Sequence[Iterator[Event]], ctxs: Sequence[RequestContext]
    ) -> dict[str, Any]:
        try:
            encoders = choice_encoders(ctxs, include_usage=True)
            return folded_choices(encoders, streams, ctxs, fold_completion, json_frames)
        finally:
            close_all(streams)

    def encode_choices_stream(
        self, streams: Sequence[Iterator[Event]], ctxs: Sequence[RequestContext]
    ) -> Iterator[bytes]:
        request = ctxs[0].request
        usage = isinstance(request, ChatGenerationRequest) and request.include_usage
        try:
            yield from sse_choices(choice_frames(choice_encoders(ctxs, usage), streams, ctxs))
        finally:
            close_all(streams)


def choice_encoders(ctxs: Sequence[RequestContext], include_usage: bool) -> list[ChatEvents]:
    """One encoder per choice, all under the first one's id."""
    encoders = [ChatEvents(ctx, include_usage=include_usage) for ctx in ctxs]
    for encoder in encoders[1:]:
        encoder.id, encoder.created = encoders[0].id, encoders[0].created
    return encoders


__all__ = ["OpenAIChat"]
