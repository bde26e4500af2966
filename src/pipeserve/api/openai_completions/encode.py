"""Pipeline events -> legacy OpenAI Completions chunks (`text_completion` objects, as dicts).

The chunks are produced once per request (CompletionEvents, on the shared base
api/framing.py): the SSE stream frames them (and `[DONE]` after the usage chunk), the
JSON body is their fold (fold.py), so streamed and non-streamed answers are the same
text by construction.

- `echo`: the first chunk carries the prompt text.
- Logprobs are the legacy shape: tokens, token_logprobs, top_logprobs (the `logprobs`
  most likely tokens and the sampled one, token -> logprob) and text_offset (character
  offset of each token in the whole text, echoed prompt included), paired with each text
  chunk from the sampled tokens (ctx.logprob_records).
- The usage chunk is sent when the client asked for it (`stream_options.include_usage`);
  the fold always asks for it. A cancelled generation ends with `[DONE]` and no finish.
- A fault is a chunk `{"error": {...}}` (the openai SDK raises APIError on it), no [DONE].
"""

from __future__ import annotations

from typing import Any

from pipeserve.api.framing import EventEncoder, Frame
from pipeserve.api.openai_common import (
    api_error_from_event,
    chat_usage,
    new_id,
    now,
    openai_error_body,
)
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError
from pipeserve.events import ContentDelta, ErrorEvent, Event, Finish, TokenText, Usage

FINISH = {"stop": "stop", "length": "length", "tool_calls": "stop"}
SYSTEM_FINGERPRINT = "fp_pipeserve"
DONE = Frame("[DONE]")


class CompletionEvents(EventEncoder):
    """One request's chunks: the chunk base, the text offset and logprob position."""

    def __init__(self, ctx: RequestContext, echo: bool, include_usage: bool) -> None:
        self.ctx = ctx
        self.base = {
            "id": new_id("cmpl-"),
            "object": "text_completion",
            "created": now(),
            "model": ctx.model_name,
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }
        self.echo = echo
        self.include_usage = include_usage
        self.offset = 0  # characters of text sent so far (for text_offset)
        self.records = 0  # ctx.logprob_records already paired with a chunk
        self.top = ctx.request.top_logprobs
        self.ended = False

    @property
    def done(self) -> bool:
        return self.ended

    def chunk(
        self, text: str, finish: str | None = None, logprobs: dict[str, Any] | None = None
    ) -> list[Frame]:
        choice = {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}
        return [Frame({**self.base, "choices": [choice]})]

    def open(self) -> list[Frame]:
        if not (self.echo and self.ctx.prompt):
            return []
        self.offset = len(self.ctx.prompt)
        return self.chunk(self.ctx.prompt)

    def feed(self, event: Event) -> list[Frame]:
        if isinstance(event, (ContentDelta, TokenText)) and event.text:
            logprobs = self.logprobs()
            self.offset += len(event.text)
            return self.chunk(event.text, logprobs=logprobs)
        if isinstance(event, Finish):
            return self.finish(event)
        if isinstance(event, Usage):
            self.ended = True
            usage = [Frame({**self.base, "choices": [], "usage": chat_usage(event)})]
            return (usage if self.include_usage else []) + [DONE]
        if isinstance(event, ErrorEvent):
            raise api_error_from_event(event)
        return []

    def finish(self, event: Finish) -> list[Frame]:
        if event.reason == "cancelled":
            self.ended = True  # client gone or request aborted: end without a finish
            return [DONE]
        if event.reason == "error":
            raise ApiError("internal", "generation failed")
        return self.chunk("", FINISH[event.reason])

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

    def close(self) -> list[Frame]:
        return self.error(ApiError("internal", "generation ended without usage"))

    def error(self, err: ApiError) -> list[Frame]:
        return [Frame(openai_error_body(err), error=err)]


__all__ = ["CompletionEvents"]
