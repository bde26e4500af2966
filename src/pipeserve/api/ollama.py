"""Ollama's API (`api: ollama` on a route prefix, conventionally /api).

Generation at `<route>/chat` and `<route>/generate` (decoding in ollama_decode, the
event -> object state machine in ollama_encode; streams are NDJSON), and the catalog:
`GET <route>/tags` (the models this route and key may use), `POST <route>/show`
(details, chat template, context length, capabilities), `GET <route>/ps` (the models
whose weights are loaded now) and `GET <route>/version`. Errors are `{"error": "message"}` with
the HTTP status, as Ollama answers; its Python client raises ResponseError on them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, ClassVar

from pipeserve import __version__
from pipeserve.api.base import ModelFacts, RequestMeta, WireProtocol, register_protocol
from pipeserve.api.ollama_decode import OllamaGenerationRequest, decode_ollama
from pipeserve.api.ollama_encode import ErrorChunk, ollama_chunks
from pipeserve.api.openai_common import cancelled_error, close_events
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError, invalid
from pipeserve.events import Event
from pipeserve.request import GenerationRequest

WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".npz", ".bin")


def ndjson(data: Mapping[str, Any]) -> bytes:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def is_chat(ctx: RequestContext) -> bool:
    request = ctx.request
    return not isinstance(request, OllamaGenerationRequest) or request.endpoint == "chat"


def fold_chunks(chunks: Iterable[dict[str, Any]], ctx: RequestContext) -> dict[str, Any]:
    """The `stream: false` object: the streamed texts joined, the calls gathered, and
    the last object's counts."""
    content: list[str] = []
    thinking: list[str] = []
    calls: list[Any] = []
    logprobs: list[Any] | None = None
    for chunk in chunks:
        if isinstance(chunk, ErrorChunk):
            raise chunk.api_error
        part = chunk.get("message", chunk)
        content.append(part.get("content", part.get("response", "")))
        thinking.append(part.get("thinking", ""))
        calls += part.get("tool_calls", [])
        if "logprobs" in chunk:
            logprobs = (logprobs or []) + chunk["logprobs"]
        if chunk["done"]:
            body = joined(chunk, "".join(content), "".join(thinking), calls)
            return body if logprobs is None else {**body, "logprobs": logprobs}
    raise cancelled_error(ctx)


def joined(last: dict[str, Any], text: str, thinking: str, calls: list[Any]) -> dict[str, Any]:
    body = dict(last)
    if "message" in body:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = calls
        body["message"] = message
    else:
        body["response"] = text
        if thinking:
            body["thinking"] = thinking
    return body


# -- catalog --------------------------------------------------------------------------


def modified_at(model: ModelFacts) -> str:
    folder = model.folder
    stamp = folder.stat().st_mtime if folder is not None and folder.exists() else 0.0
    return datetime.fromtimestamp(stamp, UTC).isoformat().replace("+00:00", "Z")


def weights_size(model: ModelFacts) -> int:
    folder = model.folder
    if folder is None or not folder.is_dir():
        return 0
    return sum(p.stat().st_size for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES)


def details(model: ModelFacts) -> dict[str, Any]:
    return {
        "parent_model": "",
        "format": "safetensors",
        "family": model.family,
        "families": [model.family],
        "parameter_size": "",
        "quantization_level": "",
    }


def card(model: ModelFacts) -> dict[str, Any]:
    digest = hashlib.sha256(f"{model.name}\0{model.source}".encode()).hexdigest()
    return {
        "name": model.name,
        "model": model.name,
        "modified_at": modified_at(model),
        "size": weights_size(model),
        "digest": digest,
        "details": details(model),
    }


def running(model: ModelFacts) -> dict[str, Any]:
    """An /api/ps entry: the memory the loaded model holds (weights when not reported)."""
    size = model.memory_bytes or weights_size(model)
    return {
        **card(model),
        "size": size,
        "size_vram": 0,
        "expires_at": None,
        "context_length": model.context_length,
    }


def show(model: ModelFacts) -> dict[str, Any]:
    info: dict[str, Any] = {"general.architecture": model.family}
    if model.context_length is not None:
        info[f"{model.family}.context_length"] = model.context_length
    return {
        "modelfile": f"# served by pipeserve\nFROM {model.source}\n",
        "parameters": "",
        "template": model.chat_template or "",
        "details": details(model),
        "model_info": info,
        "capabilities": ["completion", *sorted(model.capabilities)],
        "modified_at": modified_at(model),
    }


def find(body: Any, models: Sequence[ModelFacts]) -> ModelFacts:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    name = body.get("model") or body.get("name")  # `name` is the older spelling
    if not isinstance(name, str) or not name:
        raise invalid("model is required", "model")
    for model in models:
        if model.name == name.removesuffix(":latest"):
            return model
    raise ApiError("not_found", f"model '{name[:200]}' not found", "model")


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
            return fold_chunks(ollama_chunks(events, ctx, is_chat(ctx)), ctx)
        finally:
            close_events(events)

    def encode_stream(self, events: Iterator[Event], ctx: RequestContext) -> Iterator[bytes]:
        try:
            for chunk in ollama_chunks(events, ctx, is_chat(ctx)):
                yield ndjson(chunk)
        finally:
            close_events(events)

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return {"error": error.message}

    def fault_frame(self, error: ApiError, events_sent: int) -> bytes:
        return ndjson(self.error_body(error))

    def catalog(self, path: str, body: Any, models: Sequence[ModelFacts]) -> dict[str, Any]:
        if path == "/show":
            return show(find(body, models))
        if path == "/version":
            return {"version": __version__}
        if path == "/ps":
            return {"models": [running(model) for model in models if model.resident]}
        return {"models": [card(model) for model in models]}


__all__ = ["Ollama", "fold_chunks"]
