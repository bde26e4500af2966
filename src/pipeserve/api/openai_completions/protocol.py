"""The registered legacy OpenAI Completions protocol (`api: openai-completions`,
conventionally /v1/completions): decode (decode.py), encode as SSE or as one
`text_completion` (encode.py, fold.py), and OpenAI error bodies naming `prompt`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

from pipeserve.api.base import RequestMeta, WireProtocol, register_protocol
from pipeserve.api.openai_common import KEEPALIVE_FRAME, close_events, openai_error_body
from pipeserve.api.openai_completions.decode import CompletionGenerationRequest, decode_completion
from pipeserve.api.openai_completions.encode import KEEP_ALIVE, completion_chunks
from pipeserve.api.openai_completions.fold import fold_completion
from pipeserve.api.sse import sse_event
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError
from pipeserve.events import Event
from pipeserve.request import GenerationRequest


def echo_of(ctx: RequestContext) -> bool:
    request = ctx.request
    return isinstance(request, CompletionGenerationRequest) and request.echo


@register_protocol
class OpenAICompletions(WireProtocol):
    name: ClassVar[str] = "openai-completions"

    def decode(self, body: Any, meta: RequestMeta) -> GenerationRequest:
        return decode_completion(body)

    def encode_json(self, events: Iterator[Event], ctx: RequestContext) -> dict[str, Any]:
        try:
            return fold_completion(completion_chunks(events, ctx, echo_of(ctx)), ctx)
        finally:
            close_events(events)

    def encode_stream(self, events: Iterator[Event], ctx: RequestContext) -> Iterator[bytes]:
        request = ctx.request
        usage = isinstance(request, CompletionGenerationRequest) and request.include_usage
        try:
            for chunk in completion_chunks(events, ctx, echo_of(ctx)):
                if chunk is KEEP_ALIVE:
                    yield KEEPALIVE_FRAME
                elif "error" in chunk:
                    yield sse_event(chunk)
                    return
                elif "usage" not in chunk:
                    yield sse_event(chunk)
                elif usage:
                    yield sse_event(chunk)
            yield sse_event("[DONE]")
        finally:
            close_events(events)

    def error_body(self, error: ApiError) -> dict[str, Any]:
        body = openai_error_body(error)
        if body["error"]["param"] == "messages":  # render / context-length checks: the prompt
            body["error"]["param"] = "prompt"
        return body


__all__ = ["OpenAICompletions"]
