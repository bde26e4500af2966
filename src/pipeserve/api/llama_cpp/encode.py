"""Pipeline events -> llama.cpp's completion objects (its `/completion` and `/infill`
shape, as dicts).

A stream is SSE `data:` objects `{"index", "content", "tokens", "stop": false,
"id_slot", "tokens_predicted", "tokens_evaluated"}` per text chunk, then one final object
with `"stop": true`, `stop_type` ("eos", "word" with `stopping_word`, "limit"), the
counts and `timings`; no `[DONE]`. The non-streaming body is the fold of the same
objects (fold.py). A fault is `{"error": {"code", "message", "type"}}`, llama.cpp's
error body (plus `param`).
"""

from __future__ import annotations

import time
from typing import Any

from pipeserve.api.framing import EventEncoder, Frame
from pipeserve.api.openai_common import api_error_from_event
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError
from pipeserve.events import ContentDelta, ErrorEvent, Event, Finish, PromptReady, TokenText, Usage

ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "timeout": "timeout_error",
    "rate_limit": "unavailable_error",
    "overloaded": "unavailable_error",
    "unavailable": "unavailable_error",
}


def llama_error_body(error: ApiError, status: int) -> dict[str, Any]:
    """llama.cpp's error object (code is the HTTP status), with the field it names."""
    kind = ERROR_TYPES.get(error.kind, "server_error")
    body = {"code": status, "message": error.message, "type": kind, "param": error.param}
    return {"error": body}


class CompletionObjects(EventEncoder):
    """One request's objects: text chunks, then the final object at Usage."""

    def __init__(self, ctx: RequestContext) -> None:
        self.ctx = ctx
        self.started = time.monotonic()
        self.first_token: float | None = None
        self.predicted = 0
        self.evaluated = len(ctx.prompt_token_ids or [])
        self.cached = 0
        self.finish: Finish | None = None
        self.ended = False
        self.new_line = False

    @property
    def done(self) -> bool:
        return self.ended

    def chunk(self, text: str) -> Frame:
        return Frame(
            {
                "index": 0,
                "content": text,
                "tokens": [],
                "stop": False,
                "id_slot": 0,
                "tokens_predicted": self.predicted,
                "tokens_evaluated": self.evaluated,
            }
        )

    def feed(self, event: Event) -> list[Frame]:
        if isinstance(event, PromptReady):
            self.evaluated, self.cached = event.prompt_tokens, event.cached_tokens
        elif isinstance(event, TokenText):
            self.predicted += 1
            self.first_token = self.first_token or time.monotonic()
            return self.text(event.text)
        elif isinstance(event, ContentDelta):
            return self.text(event.text)
        elif isinstance(event, Finish):
            self.finish = event
            if event.reason == "error":
                raise ApiError("internal", "generation failed")
        elif isinstance(event, Usage):
            self.ended = True
            self.predicted, self.evaluated = event.completion_tokens, event.prompt_tokens
            return [] if self.finish and self.finish.reason == "cancelled" else [self.final()]
        elif isinstance(event, ErrorEvent):
            raise api_error_from_event(event)
        return []

    def text(self, text: str) -> list[Frame]:
        if not text:
            return []
        self.new_line = self.new_line or "\n" in text
        return [self.chunk(text)]

    def final(self) -> Frame:
        finish = self.finish or Finish("stop")
        stop_type = {"length": "limit"}.get(finish.reason, "eos")
        if finish.stop_sequence is not None:
            stop_type = "word"
        body = self.chunk("").data
        assert isinstance(body, dict)
        body.update(
            stop=True,
            model=self.ctx.model_name,
            prompt=self.ctx.prompt or "",
            has_new_line=self.new_line,
            truncated=False,
            stop_type=stop_type,
            stopping_word=finish.stop_sequence or "",
            tokens_cached=self.cached,
            timings=self.timings(),
        )
        return Frame(body)

    def timings(self) -> dict[str, float]:
        now = time.monotonic()
        first = self.first_token or now
        prompt_ms = (first - self.started) * 1000
        predicted_ms = (now - first) * 1000
        return {
            "prompt_n": self.evaluated - self.cached,
            "prompt_ms": prompt_ms,
            "prompt_per_second": rate(self.evaluated - self.cached, prompt_ms),
            "predicted_n": self.predicted,
            "predicted_ms": predicted_ms,
            "predicted_per_second": rate(self.predicted, predicted_ms),
        }

    def close(self) -> list[Frame]:
        return self.error(ApiError("internal", "generation ended without usage"))

    def error(self, err: ApiError) -> list[Frame]:
        return [Frame(llama_error_body(err, err.default_status), error=err)]


def rate(count: int, ms: float) -> float:
    return count * 1000 / ms if ms > 0 else 0.0


__all__ = ["CompletionObjects", "llama_error_body"]
