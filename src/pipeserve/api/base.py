"""The wire-protocol contract: decode client JSON, encode the event stream back.

A protocol knows nothing about model families; stages know nothing about protocols.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pipeserve.api.sse import sse_event
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError, ContextLengthError
from pipeserve.events import Event
from pipeserve.request import GenerationRequest

if TYPE_CHECKING:
    from pipeserve.store import ResponseStore


@dataclass(frozen=True)
class RequestMeta:
    """Transport facts a decoder may need (headers lower-cased)."""

    route: str
    headers: Mapping[str, str] = field(default_factory=dict)
    query: Mapping[str, str | list[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelFacts:
    """What a protocol's catalog routes may tell about a served model (Ollama's
    /api/tags and /api/show); filled in by the server from the loaded model."""

    name: str
    family: str
    source: str
    folder: Path | None = None
    context_length: int | None = None
    # beyond "completion": "tools", "thinking"; "embedding" / "rerank" for those kinds
    capabilities: frozenset[str] = frozenset()
    chat_template: str | None = None
    resident: bool = True  # weights loaded now (models loaded on demand may not be)
    memory_bytes: int = 0  # what the loaded model holds, when the engine reports it


class WireProtocol(ABC):
    name: ClassVar[str]
    overload_status: ClassVar[int] = 429
    # A request header only this protocol's clients send: routing errors (404/405) on
    # paths no endpoint owns are rendered in this protocol's shape when it is present.
    client_header: ClassVar[str | None] = None
    # True: the protocol also serves `<route>/count_tokens` (the two count_tokens_* methods).
    counts_tokens: ClassVar[bool] = False
    # True: the protocol keeps answers in the server's response store (`use_store`) and
    # serves them back on its own routes (Responses).
    stores_responses: ClassVar[bool] = False
    # Content-Type of a streamed answer (Ollama streams NDJSON, the others SSE).
    stream_content_type: ClassVar[str] = "text/event-stream; charset=utf-8"
    # Paths below the endpoint's route that generate ("": the route itself); the decoder
    # tells them apart by RequestMeta.route (Ollama: /chat and /generate under /api).
    generation_paths: ClassVar[tuple[str, ...]] = ("",)
    # Catalog paths below the route -> HTTP method (Ollama: /tags GET, /show POST), each
    # answered by `catalog` from the facts of the models the endpoint (and key) may use.
    catalog_paths: ClassVar[Mapping[str, str]] = {}

    @abstractmethod
    def decode(self, body: Any, meta: RequestMeta) -> GenerationRequest:
        """Validate and normalize a parsed JSON body; raise ApiError naming the field."""

    @abstractmethod
    def encode_json(self, events: Iterator[Event], ctx: RequestContext) -> dict[str, Any]:
        """Consume the whole stream; return the non-streaming response body."""

    @abstractmethod
    def encode_stream(self, events: Iterator[Event], ctx: RequestContext) -> Iterator[bytes]:
        """Yield SSE bytes. A mid-stream ErrorEvent becomes the protocol's error event."""

    @abstractmethod
    def error_body(self, error: ApiError) -> dict[str, Any]:
        """The protocol's own error JSON for `error`."""

    def use_store(self, store: ResponseStore) -> None:
        """Hand the protocol the server's response store (only where stores_responses)."""
        raise NotImplementedError(f"{self.name} does not store responses")

    def count_tokens_body(self, body: Any, meta: RequestMeta) -> GenerationRequest:
        """Decode a count_tokens body (only where counts_tokens is True)."""
        raise NotImplementedError(f"{self.name} does not count tokens")

    def count_tokens_response(self, input_tokens: int) -> dict[str, Any]:
        """The count_tokens answer body (only where counts_tokens is True)."""
        raise NotImplementedError(f"{self.name} does not count tokens")

    def catalog(self, path: str, body: Any, models: Sequence[ModelFacts]) -> dict[str, Any]:
        """The answer of a catalog path (only where catalog_paths names it); `body` is
        the parsed JSON of a POST, else None. Raise ApiError for a bad request."""
        raise NotImplementedError(f"{self.name} has no catalog path {path!r}")

    def stream_fault(self, error: ApiError, events_sent: int) -> dict[str, Any]:
        """The `error` SSE event's data when the encoder itself failed after
        `events_sent` events; Chat and Anthropic send their usual error body."""
        return self.error_body(error)

    def fault_frame(self, error: ApiError, events_sent: int) -> bytes:
        """The bytes that end a stream whose encoder failed: an SSE `error` event."""
        return sse_event(self.stream_fault(error, events_sent), "error")

    def error_status(self, error: ApiError) -> int:
        if error.kind == "overloaded":
            return self.overload_status
        return error.default_status


def context_overflow(error: ApiError) -> tuple[int, int] | None:
    """(prompt tokens, context length) when `error` says the prompt does not fit."""
    if isinstance(error, ContextLengthError):
        return error.prompt_tokens, error.context_length
    return None


PROTOCOL_REGISTRY: dict[str, type[WireProtocol]] = {}


def register_protocol(cls: type[WireProtocol]) -> type[WireProtocol]:
    PROTOCOL_REGISTRY[cls.name] = cls
    return cls
