"""The registered legacy OpenAI Completions protocol (`api: openai-completions`,
conventionally /v1/completions): decode (decode.py), encode as SSE or as one
`text_completion` (encode.py, fold.py, on the shared base api/framing.py), and OpenAI
error bodies naming `prompt`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

from pipeserve.api.base import RequestMeta, WireProtocol, register_protocol
from pipeserve.api.choices import ChoicesEncoding
from pipeserve.api.framing import Frame, json_frames, sse_frames
from pipeserve.api.openai_common import close_events, openai_error_body
from pipeserve.api.openai_completions.decode import CompletionGenerationRequest, decode_completion
from pipeserve.api.openai_completions.encode import CompletionEvents
from pipeserve.api.openai_completions.fold import fold_completion
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError
from pipeserve.events import Event
from pipeserve.request import GenerationRequest


def completion_events(ctx: RequestContext, fold: bool) -> CompletionEvents:
    """The request's chunk encoder; a fold always asks for the usage chunk."""
    request = ctx.request
    completion = request if isinstance(request, CompletionGenerationRequest) else None
    echo = completion is not None and completion.echo
    usage = fold or (completion is not None and completion.include_usage)
    return CompletionEvents(ctx, echo=echo, include_usage=usage)


@register_protocol
class OpenAICompletions(ChoicesEncoding, WireProtocol):
    name: ClassVar[str] = "openai-completions"

    def decode(self, body: Any, meta: RequestMeta) -> GenerationRequest:
        return decode_completion(body)

    def encode_json(self, events: Iterator[Event], ctx: RequestContext) -> dict[str, Any]:
        try:
            frames = json_frames(completion_events(ctx, fold=True), events, ctx)
            return fold_completion(frames, ctx)
        finally:
            close_events(events)

    def encode_stream(self, events: Iterator[Event], ctx: RequestContext) -> Iterator[bytes]:
        try:
            yield from sse_frames(completion_events(ctx, fold=False), events, ctx)
        finally:
            close_events(events)

    def choice_encoders(
        self, ctxs: Sequence[RequestContext], folded: bool
    ) -> list[CompletionEvents]:
        """One encoder per choice, all under the first one's id."""
        encoders = [completion_events(ctx, folded) for ctx in ctxs]
        for encoder in encoders[1:]:
            encoder.base = encoders[0].base
        return encoders

    def fold_choice(self, frames: Iterator[Frame], ctx: RequestContext) -> dict[str, Any]:
        return fold_completion(frames, ctx)

    def error_body(self, error: ApiError) -> dict[str, Any]:
        body = openai_error_body(error)
        if body["error"]["param"] == "messages":  # render / context-length checks: the prompt
            body["error"]["param"] = "prompt"
        return body


__all__ = ["OpenAICompletions"]
