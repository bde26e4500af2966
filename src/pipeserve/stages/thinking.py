"""`thinking`: split generated text into reasoning and content at the think markers.

Content tokens pass on as TokenText (same token id, text trimmed when a token straddles
a marker) so the tool-call stage still sees them; reasoning becomes ReasoningDelta.
Starts inside reasoning when the rendered prompt already opened the think block.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import ClassVar

from pipeserve.constraint import Envelope
from pipeserve.context import ThinkMarkers
from pipeserve.events import ContentDelta, Event, Finish, ReasoningDelta, TokenText, Usage
from pipeserve.stages.base import BuildEnv, RequestContext, StageParams, register_stage
from pipeserve.stages.toolfmt.markers import MarkerSet, Splitter


class ThinkingParams(StageParams):
    start: str = "<think>"
    end: str = "</think>"
    emit_tags_in_content: bool = False  # raw `<think>...</think>` text in content instead
    strip_leading_newlines: bool = True  # drop newlines right after a marker / before the end


class _Split:
    """Per-request state: one token in, events out."""

    def __init__(
        self, params: ThinkingParams, start_set: MarkerSet, end_set: MarkerSet, reasoning: bool
    ) -> None:
        self.p = params
        self.sets = (start_set, end_set)  # indexed by self.reasoning: what to look for next
        self.splitter = Splitter()
        self.reasoning = reasoning
        self.strip = params.strip_leading_newlines and not params.emit_tags_in_content
        self.fresh = reasoning  # at the start of a segment (leading newlines are dropped)
        self.newlines = ""  # reasoning newlines held until we know the end marker is not next
        self.tokens = 0

    def feed(self, token: TokenText, out: list[Event]) -> None:
        if self.reasoning:
            self.tokens += 1
        counted = self.reasoning
        buf = self.splitter.take(token.text)
        while buf:
            before, marker, after = self.splitter.split(buf, self.sets[self.reasoning])
            if before:
                self._emit(before, token, out)
            if marker is None:
                self.splitter.held = after
                break
            self._switch(marker, out)
            if self.reasoning and not counted:
                self.tokens, counted = self.tokens + 1, True
            buf = after

    def flush(self, token: TokenText | None, out: list[Event]) -> None:
        held = self.splitter.flush()
        if held:
            self._emit(held, token or TokenText("", -1), out)
        self.newlines = ""  # trailing reasoning newlines at a cut: whitespace only, dropped

    def _switch(self, marker: str, out: list[Event]) -> None:
        self.reasoning = not self.reasoning
        self.fresh, self.newlines = True, ""
        if self.p.emit_tags_in_content:
            out.append(ContentDelta(marker))

    def _emit(self, text: str, token: TokenText, out: list[Event]) -> None:
        if self.strip and self.fresh:
            text = text.lstrip("\n")
            if not text:
                return
        self.fresh = False
        if not self.reasoning:
            same = text == token.text
            out.append(
                token
                if same
                else TokenText(text, token.token_id, token.logprob, token.top_logprobs)
            )
            return
        if self.p.emit_tags_in_content:
            out.append(ContentDelta(text))
            return
        if self.strip:
            body = text.rstrip("\n")
            text, tail = self.newlines + body, text[len(body) :]
            self.newlines = tail if body else self.newlines + tail
            if not body:
                return
        out.append(ReasoningDelta(text))


class ThinkingStage:
    parses_output: ClassVar[bool] = True  # skipped for raw prompts (stages/base.py Chain)
    capabilities: ClassVar[frozenset[str]] = frozenset({"thinking"})

    def __init__(self, params: ThinkingParams) -> None:
        self.params = params
        self.start_set = MarkerSet([params.start])
        self.end_set = MarkerSet([params.end])

    def prepare(self, ctx: RequestContext) -> None:
        ctx.think_close = self.params.end + "\n\n"  # tool_calls' prefill leaves the block
        ctx.think_markers = ThinkMarkers(self.params.start, self.params.end, ctx.think_close)
        # Structured output starts after the reasoning (stages/grammar_plan.py); with
        # reasoning off no think block is allowed before the answer.
        if ctx.request.reasoning.enabled is not False or ctx.prompt_opened_thinking:
            ctx.envelope = Envelope(
                reasoning_open=self.params.start, reasoning_close=self.params.end
            )

    def __call__(self, events: Iterator[Event], ctx: RequestContext) -> Iterator[Event]:
        state: _Split | None = None
        last: TokenText | None = None
        out: list[Event] = []
        for event in events:
            if type(event) is TokenText:
                if state is None:  # read lazily: tool_calls' prepare may have closed the block
                    state = self._open(ctx, out)
                state.feed(event, out)
                last = event
                if out:
                    yield from out
                    out.clear()
            elif type(event) is Finish:
                if state is not None:
                    state.flush(last, out)
                    yield from out
                    out.clear()
                yield event
            elif type(event) is Usage:
                tokens = state.tokens if state is not None else 0
                yield dataclasses.replace(event, reasoning_tokens=event.reasoning_tokens + tokens)
            else:
                yield event
        if state is not None:
            state.flush(last, out)
            yield from out

    def _open(self, ctx: RequestContext, out: list[Event]) -> _Split:
        reasoning = ctx.prompt_opened_thinking
        if reasoning and self.params.emit_tags_in_content:
            out.append(ContentDelta(self.params.start))
        return _Split(self.params, self.start_set, self.end_set, reasoning)


@register_stage("thinking", ThinkingParams)
def build_thinking(params: ThinkingParams, env: BuildEnv) -> ThinkingStage:
    """Split generated text into reasoning and content at the family's think markers."""
    return ThinkingStage(params)
