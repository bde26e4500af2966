"""One log line per request, written when its response body is finished (streams too).

RequestLogMiddleware opens a RequestRecord for every request and writes it when Falcon
is done with the response, unless a resource deferred it to the end of a body it hands
to the server (generation responses, whose bodies are written after Falcon returns): a
LoggedBody then writes it when the server closes that body. Fields (the JSON keys with
`server.log_format: json`): request_id, method, path, protocol, model, key (the key's
name, never the key), status, stream, prompt_tokens, completion_tokens, cached_tokens,
proposed_tokens and accepted_tokens (speculative decoding), ttft_ms, duration_ms,
finish_reason, error, client_disconnected.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import falcon

from pipeserve.events import (
    ContentDelta,
    ErrorEvent,
    Event,
    Finish,
    ReasoningDelta,
    TokenText,
    ToolCallStart,
    Usage,
)

log = logging.getLogger("pipeserve.request")
FIRST_OUTPUT = (ContentDelta, ReasoningDelta, TokenText, ToolCallStart)


@dataclass
class RequestRecord:
    request_id: str
    method: str
    path: str
    protocol: str | None = None
    model: str | None = None
    key: str | None = None
    status: int | None = None
    stream: bool | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    proposed_tokens: int | None = None  # speculative decoding (None: nothing proposed)
    accepted_tokens: int | None = None
    ttft_ms: float | None = None
    duration_ms: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    client_disconnected: bool = False
    started: float = field(default_factory=time.monotonic, repr=False)
    deferred: bool = field(default=False, repr=False)
    written: bool = field(default=False, repr=False)

    def observe(self, events: Iterable[Event]) -> Iterator[Event]:
        """Pass every event through, noting first output, usage, finish and errors."""
        for event in events:
            if self.ttft_ms is None and isinstance(event, FIRST_OUTPUT) and _has_text(event):
                self.ttft_ms = _ms(time.monotonic() - self.started)
            elif isinstance(event, Usage):
                self.prompt_tokens = event.prompt_tokens
                self.completion_tokens = event.completion_tokens
                self.cached_tokens = event.cached_tokens
                if event.proposed_tokens:
                    self.proposed_tokens = event.proposed_tokens
                    self.accepted_tokens = event.accepted_tokens
            elif isinstance(event, Finish):
                self.finish_reason = event.reason
            elif isinstance(event, ErrorEvent):
                self.error = event.kind
            yield event

    def note_cancel(self, reason: str | None) -> None:
        if reason == "client_disconnected":
            self.client_disconnected = True

    def write(self) -> None:
        if self.written:
            return
        self.written = True
        self.duration_ms = _ms(time.monotonic() - self.started)
        fields = {
            k: v for k, v in asdict(self).items() if k not in ("started", "deferred", "written")
        }
        level = logging.WARNING if (self.status or 0) >= 500 else logging.INFO
        log.log(level, human_line(fields), extra=fields)


def human_line(fields: dict[str, Any]) -> str:
    parts = [str(fields["request_id"]), str(fields["method"]), str(fields["path"])]
    parts += [f"{name}={fields[name]}" for name in ("protocol", "model", "key", "status")]
    if fields["prompt_tokens"] is not None:
        parts.append(
            f"tokens={fields['prompt_tokens']}+{fields['completion_tokens']}"
            f" cached={fields['cached_tokens']}"
        )
    if fields["proposed_tokens"] is not None:
        parts.append(f"speculative={fields['accepted_tokens']}/{fields['proposed_tokens']}")
    if fields["ttft_ms"] is not None:
        parts.append(f"ttft={fields['ttft_ms']}ms")
    parts.append(f"duration={fields['duration_ms']}ms")
    for name in ("stream", "finish_reason", "error"):
        if fields[name] is not None:
            parts.append(f"{name}={fields[name]}")
    if fields["client_disconnected"]:
        parts.append("client_disconnected")
    return " ".join(part for part in parts if not part.endswith("=None"))


def _has_text(event: Event) -> bool:
    return not isinstance(event, (ContentDelta, ReasoningDelta, TokenText)) or bool(event.text)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


class LoggedBody:
    """A WSGI body that writes its request's log line when the server closes it. Closed
    before its last chunk was taken means the client went away."""

    def __init__(self, body: Iterator[bytes], record: RequestRecord) -> None:
        self._body = body
        self._record = record
        self._finished = False

    def __iter__(self) -> LoggedBody:
        return self

    def __next__(self) -> bytes:
        try:
            return next(self._body)
        except StopIteration:
            self._finished = True
            raise

    def close(self) -> None:
        try:
            close = getattr(self._body, "close", None)
            if close is not None:
                close()
        finally:
            if not self._finished:
                self._record.client_disconnected = True
            self._record.write()


def record_of(req: falcon.Request) -> RequestRecord | None:
    record = getattr(req.context, "request_record", None)
    return record if isinstance(record, RequestRecord) else None


def annotate(req: falcon.Request, **facts: str | None) -> None:
    """Set fields of the request's log line (protocol, key, model, error)."""
    record = record_of(req)
    if record is not None:
        for name, value in facts.items():
            setattr(record, name, value)


class RequestLogMiddleware:
    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        req.context.request_record = RequestRecord(
            str(getattr(req.context, "request_id", "") or "-"), req.method, req.path
        )

    def process_response(
        self, req: falcon.Request, resp: falcon.Response, resource: Any, req_succeeded: bool
    ) -> None:
        record = record_of(req)
        if record is None:
            return
        record.status = resp.status_code
        if not record.deferred:
            record.write()


__all__ = ["LoggedBody", "RequestLogMiddleware", "RequestRecord", "annotate", "record_of"]
