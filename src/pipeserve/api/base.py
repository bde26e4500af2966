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
from pipeserve.request import DetokenizeRequest, GenerationRequest, TokenizeRequest
from pipeserve.store.base import NOBODY_IN_PARTICULAR, Owner

if TYPE_CHECKING:
    from pipeserve.store import ResponseStore


@dataclass(frozen=True)
class RequestMeta:
    """Transport facts a decoder may need (headers lower-cased)."""

    route: str
    headers: Mapping[str, str] = field(default_factory=dict)
    query: Mapping[str, str | list[str]] = field(default_factory=dict)
    # Whose stored responses the request may continue and reference (its API key and the
    # models that key may use on this route).
    store_owner: Owner = NOBODY_IN_PARTICULAR


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
    # Tokenizer paths below the route -> "tokenize" or "detokenize" (llama.cpp's
    # /tokenize, /detokenize), served by server/tokenize.py with the protocol's shapes
    # (the tokenize_* / detokenize_* methods).
    token_paths: ClassVar[Mapping[str, str]] = {}
    # True: a request may leave out `model` where its route serves one model (llama.cpp).
    model_optional: ClassVar[bool] = False
    # True: the protocol answers a request's n choices (`GenerationRequest.n`) through the
    # encode_choices_* methods (Chat, Completions).
    serves_choices: ClassVar[bool] = False

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

    def encode_choices_json(
        self, streams: Sequence[Iterator[Event]], ctxs: Sequence[RequestContext]
    ) -> dict[str, Any]:
        """The non-streaming body of n choices, one event stream and context each (only
        where serves_choices)."""
        raise NotImplementedError(f"{self.name} does not serve n choices")

    def encode_choices_stream(
        self, streams: Sequence[Iterator[Event]], ctxs: Sequence[RequestContext]
    ) -> Iterator[bytes]:
        """The stream of n choices, their chunks interleaved by index."""
        raise NotImplementedError(f"{self.name} does not serve n choices")

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

    def tokenize_body(self, body: Any) -> TokenizeRequest:
        """Decode a tokenize body (only where token_paths names tokenize)."""
        raise NotImplementedError(f"{self.name} does not tokenize")

    def tokenize_response(self, tokens: list[int], pieces: list[Any] | None) -> dict[str, Any]:
        """The tokenize answer; pieces (with_pieces): each token's text, or its bytes as
        a list of ints where they are not UTF-8 on their own."""
        raise NotImplementedError(f"{self.name} does not tokenize")

    def detokenize_body(self, body: Any) -> DetokenizeRequest:
        """Decode a detokenize body (only where token_paths names detokenize)."""
        raise NotImplementedError(f"{self.name} does not detokenize")

    def detokenize_response(self, text: str) -> dict[str, Any]:
        raise NotImplementedError(f"{self.name} does not detokenize")

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
