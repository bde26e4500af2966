"""Pipeline events -> legacy OpenAI Completions chunks (`text_completion` objects, as dicts).

One state machine (`completion_chunks`) drives both encoders, as for Anthropic Messages:
the SSE encoder frames each chunk (and `[DONE]` after the usage chunk), the JSON encoder
folds them into one `text_completion` (fold.py), so streamed
and non-streamed answers are the same text by construction.

- `echo`: the first chunk carries the prompt text.
- Logprobs are the legacy shape: tokens, token_logprobs, top_logprobs (the `logprobs`
  most likely tokens and the sampled one, token -> logprob) and text_offset (character
  offset of each token in the whole text, echoed prompt included), paired with each text
  chunk from the sampled tokens (ctx.logprob_records).
- A fault is a chunk `{"error": {...}}` (the openai SDK raises APIError on it), no [DONE].
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from pipeserve.api.framing import chunks_then_drain
from pipeserve.api.openai_common import chat_usage, new_id, now, openai_error_body
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError
from pipeserve.events import (
    ContentDelta,
    ErrorEvent,
    Event,
    Finish,
    KeepAlive,
    TokenText,
    Usage,
)

KEEP_ALIVE: dict[str, Any] = {"object": "keep-alive"}  # framed as an SSE comment, never folded
FINISH = {"stop": "stop", "length": "length", "tool_calls": "stop"}
SYSTEM_FINGERPRINT = "fp_pipeserve"


class _Completion:
    """Per-request state: the chunk base, the text offset and logprob position."""

    def __init__(self, ctx: RequestContext, echo: bool) -> None:
        self.ctx = ctx
        self.base = {
            "id": new_id("cmpl-"),
            "object": "text_completion",
            "created": now(),
            "model": ctx.model_name,
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }
        self.echo = echo
        self.offset = 0  # characters of text sent so far (for text_offset)
        self.records = 0  # ctx.logprob_records already paired with a chunk
        self.top = ctx.request.top_logprobs
        self.done = self.failed = False

    def chunk(
        self, text: str, finish: str | None = None, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        choice = {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}
        return {**self.base, "choices": [choice]}

    def start(self) -> Iterator[dict[str, Any]]:
        if self.echo and self.ctx.prompt:
            yield self.chunk(self.ctx.prompt)
            self.offset = len(self.ctx.prompt)

    def handle(self, event: Event) -> Iterator[dict[str, Any]]:
        if isinstance(event, (ContentDelta, TokenText)) and event.text:
            logprobs = self.logprobs()
            self.offset += len(event.text)
            yield self.chunk(event.text, logprobs=logprobs)
        elif isinstance(event, Finish):
            yield from self.finish(event)
        elif isinstance(event, Usage):
            yield {**self.base, "choices": [], "usage": chat_usage(event)}
            self.done = True
        elif isinstance(event, ErrorEvent):
            yield from self.fail(event.kind, event.message)
        elif isinstance(event, KeepAlive):
            yield KEEP_ALIVE

    def finish(self, event: Finish) -> Iterator[dict[str, Any]]:
        if event.reason == "cancelled":
            self.done = True  # client gone or request aborted: end without a finish
        elif event.reason == "error":
            yield from self.fail("internal", "generation failed")
        else:
            yield self.chunk("", FINISH[event.reason])

    def fail(self, kind: str, message: str) -> Iterator[dict[str, Any]]:
        self.done = self.failed = True
        yield openai_error_body(ApiError(kind, message))  # type: ignore[arg-type]

    def logprobs(self) -> dict[str, Any] | None:
        """The legacy logprobs of the tokens sampled since the previous text chunk."""
        pending = self.ctx.logprob_records[self.records :]
        self.records = len(self.ctx.logprob_records)
        if not self.ctx.request.logprobs:
            return None
        out: dict[str, Any] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        offset = self.offset
        for token in pending:
            tops = {t.token: t.logprob for t in token.top_logprobs[: self.top]}
            if token.logprob is not None:
                tops.setdefault(token.text, token.logprob)
            out["tokens"].append(token.text)
            out["token_logprobs"].append(token.logprob)
            out["top_logprobs"].append(tops)
            out["text_offset"].append(offset)
            offset += len(token.text)
        return out

    def close(self) -> Iterator[dict[str, Any]]:
        if not self.done:
            yield from self.fail("internal", "generation ended without usage")


def completion_chunks(
    events: Iterable[Event], ctx: RequestContext, echo: bool
) -> Iterator[dict[str, Any]]:
    """The Completions chunks for one request's pipeline events, then
    the rest of the stream drained (api/framing.py `chunks_then_drain`)."""
    state = _Completion(ctx, echo)
    yield from state.start()
    yield from chunks_then_drain(state, events, ctx)


__all__ = ["KEEP_ALIVE", "completion_chunks"]
