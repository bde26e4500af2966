"""Ollama's API (`api: ollama` on a route prefix, conventionally /api).

Generation at `<route>/chat` and `<route>/generate` (decoding in decode.py, the event ->
object encoder in encode.py and its fold in fold.py, on the shared base api/framing.py;
streams are NDJSON), and the catalog (catalog.py): `GET <route>/tags`, `POST
<route>/show`, `GET <route>/ps` and `GET <route>/version`. Errors are `{"error": "message"}` with the HTTP status, as Ollama
answers; its Python client raises ResponseError on them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

from pipeserve import __version__
from pipeserve.api.base import ModelFacts, RequestMeta, WireProtocol, register_protocol
from pipeserve.api.framing import json_frames, ndjson_frames, ndjson_line
from pipeserve.api.ollama.catalog import card, find, running, show
from pipeserve.api.ollama.decode import OllamaGenerationRequest, decode_ollama
from pipeserve.api.ollama.encode import OllamaEvents
from pipeserve.api.ollama.fold import fold_chunks
from pipeserve.api.openai_common import close_events
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError
from pipeserve.events import Event
from pipeserve.request import GenerationRequest


def ollama_events(ctx: RequestContext) -> OllamaEvents:
    request = ctx.request
    chat = not isinstance(request, OllamaGenerationRequest) or request.endpoint == "chat"
    return OllamaEvents(ctx, chat)


@register_protocol
class Ollama(WireProtocol):
    name: ClassVar[str] = "ollama"
    stream_content_type: ClassVar[str] = "application/x-ndjson"
    generation_paths: ClassVar[tuple[str, ...]] = ("/chat", "/generate")
    catalog_paths: ClassVar[Mapping[str, str]] = {
        "/tags": "GET",
        "/show": "POST",
        "/ps": "GET",
        "/version": "GET",
    }

    def decode(self, body: Any, meta: RequestMeta) -> GenerationRequest:
        generate = meta.route.endswith("/generate")
        return decode_ollama(body, "generate" if generate else "chat")

    def encode_json(self, events: Iterator[Event], ctx: RequestContext) -> dict[str, Any]:
        try:
            return fold_chunks(json_frames(ollama_events(ctx), events, ctx), ctx)
        finally:
            close_events(events)

    def encode_stream(self, events: Iterator[Event], ctx: RequestContext) -> Iterator[bytes]:
        try:
            yield from ndjson_frames(ollama_events(ctx), events, ctx)
        finally:
            close_events(events)

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return {"error": error.message}

    def fault_frame(self, error: ApiError, events_sent: int) -> bytes:
        return ndjson_line(self.error_body(error))

    def catalog(self, path: str, body: Any, models: Sequence[ModelFacts]) -> dict[str, Any]:
        if path == "/show":
            return show(find(body, models))
        if path == "/version":
            return {"version": __version__}
        if path == "/ps":
            return {"models": [running(model) for model in models if model.resident]}
        return {"models": [card(model) for model in models]}


__all__ = ["Ollama"]
