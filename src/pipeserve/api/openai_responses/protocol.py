"""The registered OpenAI Responses protocol (`api: openai-responses`, conventionally
/v1/responses): decode (decode.py, with the response store's state.py), encode as SSE or
as one Response object (encode.py, fold.py, on the shared base api/framing.py), and
OpenAI error bodies; a stream's fault is a typed `error` event."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

from pipeserve.api.base import RequestMeta, WireProtocol, register_protocol
from pipeserve.api.framing import json_frames, sse_frames
from pipeserve.api.openai_common import close_events, openai_error_body
from pipeserve.api.openai_responses.decode import ResponsesGenerationRequest, decode_responses
from pipeserve.api.openai_responses.encode import ResponseEvents
from pipeserve.api.openai_responses.fold import fold_response
from pipeserve.api.openai_responses.state import ResponsesState
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError
from pipeserve.events import Event
from pipeserve.request import GenerationRequest
from pipeserve.store import ResponseStore


def _echo_of(ctx: RequestContext) -> dict[str, Any]:
    request = ctx.request
    return request.echo if isinstance(request, ResponsesGenerationRequest) else {}


@register_protocol
class OpenAIResponses(WireProtocol):
    name = "openai-responses"
    stores_responses: ClassVar[bool] = True

    def __init__(self) -> None:
        self.state = ResponsesState()  # stateless until the app gives it a store

    def use_store(self, store: ResponseStore) -> None:
        self.state = ResponsesState(store)

    def decode(self, body: Any, meta: RequestMeta) -> GenerationRequest:
        return decode_responses(body, self.state, meta.store_owner)

    def keep(self, ctx: RequestContext, response: dict[str, Any]) -> None:
        """Store the finished response (before the client can see it end)."""
        request = ctx.request
        if isinstance(request, ResponsesGenerationRequest):
            model = ctx.served_model or None
            self.state.keep(request.stored_input, response, request.store_owner, model)

    def encode_json(self, events: Iterator[Event], ctx: RequestContext) -> dict[str, Any]:
        """The response of the last stream event (response.completed / .incomplete)."""
        try:
            frames = json_frames(ResponseEvents(ctx, _echo_of(ctx), self.keep), events, ctx)
            return fold_response(frames)
        finally:
            close_events(events)

    def encode_stream(self, events: Iterator[Event], ctx: RequestContext) -> Iterator[bytes]:
        try:
            yield from sse_frames(ResponseEvents(ctx, _echo_of(ctx), self.keep), events, ctx)
        finally:
            close_events(events)

    def stream_fault(self, error: ApiError, events_sent: int) -> dict[str, Any]:
        """Responses streams carry errors as a typed `error` event with the next
        sequence number (the SDK's ResponseErrorEvent)."""
        detail = self.error_body(error)["error"]
        return {"type": "error", "code": detail["code"] or detail["type"], "message": detail["message"],
                "param": detail["param"], "sequence_number": events_sent}  # fmt: skip

    def error_body(self, error: ApiError) -> dict[str, Any]:
        body = openai_error_body(error)
        if body["error"]["param"] == "messages":  # stages name the prompt as Chat does
            body["error"]["param"] = "input"
        return body


__all__ = ["OpenAIResponses"]
