"""The wire-protocol contract: decode client JSON, encode the event stream back.

A protocol knows nothing about model families; stages know nothing about protocols.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pipeserve.api.sse import sse_event
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError, ContextLengthError
from pipeserve.events import Event
from pipeserve.request import GenerationRequest


@dataclass(frozen=True)
class RequestMeta:
    """Transport facts a decoder may need (headers lower-cased)."""

    route: str
    headers: Mapping[str, str] = field(default_factory=dict)
    query: Mapping[str, str] = field(default_factory=dict)


class WireProtocol(ABC):
    name: ClassVar[str]
    overload_status: ClassVar[int] = 429
    # A request header only this protocol's clients send: routing errors (404/405) on
    # paths no endpoint owns are rendered in this protocol's shape when it is present.
    client_header: ClassVar[str | None] = None
    # True: the protocol also serves `<route>/count_tokens` (the two count_tokens_* methods).
    counts_tokens: ClassVar[bool] = False
    # Content-Type of a streamed answer (Ollama streams NDJSON, the others SSE).
    stream_content_type: ClassVar[str] = "text/event-stream; charset=utf-8"

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

    def count_tokens_body(self, body: Any, meta: RequestMeta) -> GenerationRequest:
        """Decode a count_tokens body (only where counts_tokens is True)."""
        raise NotImplementedError(f"{self.name} does not count tokens")

    def count_tokens_response(self, input_tokens: int) -> dict[str, Any]:
        """The count_tokens answer body (only where counts_tokens is True)."""
        raise NotImplementedError(f"{self.name} does not count tokens")

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
