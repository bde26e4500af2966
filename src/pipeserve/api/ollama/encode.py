"""Pipeline events -> Ollama's streamed objects (as dicts), for /api/chat and /api/generate.

The objects are produced once per request (OllamaEvents, on the shared base
api/framing.py): the stream writes each as one NDJSON line (`ndjson_frames`), the JSON
body of `stream: false` is their fold (fold.py), so streamed and non-streamed answers
agree by construction.

- Chat chunks carry `message` (role, content, and `thinking` / `tool_calls` when
  present); generate chunks carry `response` (and `thinking`). Each has `model`,
  `created_at` (RFC 3339, UTC) and `done: false`.
- A tool call is sent once complete, as Ollama does, with `function.arguments` as an
  object; a call whose arguments are not a JSON object is sent as content instead.
- The last object has `done: true`, `done_reason` (stop / length), and the counts and
  durations in nanoseconds: total_duration, load_duration (0: models stay loaded),
  prompt_eval_count / prompt_eval_duration (admission to first output),
  eval_count / eval_duration (first output to the end).
- `logprobs: true`: each content chunk carries `logprobs` (token, logprob,
  top_logprobs) of the tokens sampled since the previous chunk.
- While nothing is generated (queue, long prefill) an empty chunk keeps the connection
  visibly alive (NDJSON has no comment line); a fault is an `{"error": "..."}` line, as
  Ollama's own streams end (its ApiError keeps the kind, so a `stream: false` answer has
  the fault's status: a timeout is a 504, not a 500).
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

from pipeserve.api.framing import EventEncoder, Frame
from pipeserve.api.openai_common import api_error_from_event
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError
from pipeserve.events import (
    ContentDelta,
    ErrorEvent,
    Event,
    Finish,
    PromptReady,
    ReasoningDelta,
    TokenText,
    ToolCallEnd,
    ToolCallStart,
    Usage,
    arguments_valid,
)

DONE_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop"}


def created_at() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def nanoseconds(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


class OllamaEvents(EventEncoder):
    """One request's objects: which endpoint's shape, pending tool calls, timings."""

    def __init__(self, ctx: RequestContext, chat: bool) -> None:
        self.ctx = ctx
        self.chat = chat
        self.started = time.monotonic()
        self.admitted: float | None = None
        self.first_output: float | None = None
        self.calls: dict[int, ToolCallStart] = {}
        self.records = 0  # ctx.logprob_records already sent
        self.finish: Finish | None = None
        self.ended = False

    @property
    def done(self) -> bool:
        return self.ended

    def chunk(
        self, text: str = "", thinking: str = "", calls: list[Any] | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.ctx.model_name, "created_at": created_at()}
        body.update(answer_fields(self.chat, text, thinking, calls))
        body["done"] = False
        return body

    def keepalive(self) -> list[Frame]:
        return [Frame(self.chunk())]

    def feed(self, event: Event) -> list[Frame]:
        if isinstance(event, (ContentDelta, TokenText)) and event.text:
            self.output()
            logprobs = self.logprobs()
            chunk = self.chunk(text=event.text)
            if logprobs is not None:
                chunk["logprobs"] = logprobs
            return [Frame(chunk)]
        if isinstance(event, ReasoningDelta) and event.text:
            self.output()
            self.logprobs()  # reasoning tokens carry none
            return [Frame(self.chunk(thinking=event.text))]
        if isinstance(event, ToolCallStart):
            self.output()
            self.calls[event.index] = event
        elif isinstance(event, ToolCallEnd):
            return self.tool_call(event)
        elif isinstance(event, PromptReady):
            self.admitted = time.monotonic()
        elif isinstance(event, Finish):
            self.on_finish(event)
        elif isinstance(event, Usage):
            return self.end(event)
        elif isinstance(event, ErrorEvent):
            raise api_error_from_event(event)
        return []

    def logprobs(self) -> list[dict[str, Any]] | None:
        """The logprobs of the tokens sampled since the previous chunk (when asked)."""
        pending = self.ctx.logprob_records[self.records :]
        self.records = len(self.ctx.logprob_records)
        if not self.ctx.request.logprobs:
            return None
        top = self.ctx.request.top_logprobs
        return [
            {
                "token": token.text,
                "logprob": token.logprob,
                "top_logprobs": [
                    {"token": t.token, "logprob": t.logprob} for t in token.top_logprobs[:top]
                ],
            }
            for token in pending
            if token.logprob is not None
        ]

    def output(self) -> None:
        if self.first_output is None:
            self.first_output = time.monotonic()

    def tool_call(self, event: ToolCallEnd) -> list[Frame]:
        start = self.calls.pop(event.index, None)
        if start is None:
            return []
        if not arguments_valid(event.arguments):
            return [Frame(self.chunk(text=event.arguments))]  # not a JSON object: no call
        arguments = json.loads(event.arguments) if event.arguments.strip() else {}
        call = {"function": {"name": start.name, "arguments": arguments}}
        return [Frame(self.chunk(calls=[call]))] if self.chat else []

    def on_finish(self, event: Finish) -> None:
        if event.reason == "cancelled":
            self.ended = True  # client gone or request aborted: end without done
        elif event.reason == "error":
            raise ApiError("internal", "generation failed")
        else:
            self.finish = event

    def end(self, usage: Usage) -> list[Frame]:
        if self.finish is None:
            return []
        now = time.monotonic()
        admitted = self.admitted or self.started
        first = self.first_output or now
        last = self.chunk()
        last.update(
            done=True,
            done_reason=DONE_REASONS[self.finish.reason],
            total_duration=nanoseconds(now - self.started),
            load_duration=0,
            prompt_eval_count=usage.prompt_tokens,
            prompt_eval_duration=nanoseconds(first - admitted),
            eval_count=usage.completion_tokens,
            eval_duration=nanoseconds(now - first),
        )
        self.ended = True
        return [Frame(last)]

    def close(self) -> list[Frame]:
        return self.error(ApiError("internal", "generation ended without a finish reason"))

    def error(self, err: ApiError) -> list[Frame]:
        return [Frame({"error": err.message}, error=err)]


def answer_fields(
    chat: bool, text: str, thinking: str = "", calls: list[Any] | None = None
) -> dict[str, Any]:
    """The answer part of a chunk or body: /api/chat's `message`, or /api/generate's
    `response` (and `thinking`)."""
    if not chat:
        return {"response": text, **({"thinking": thinking} if thinking else {})}
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if thinking:
        message["thinking"] = thinking
    if calls:
        message["tool_calls"] = calls
    return {"message": message}


__all__ = ["OllamaEvents", "created_at"]
