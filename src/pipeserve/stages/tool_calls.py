"""`tool_calls`: turn generated tokens into content and tool calls (json | glm | kimi | harmony).

Markers and the tool_choice prefills default per format and can be overridden in YAML.
For tool_choice `required` / `function`, prepare() appends the format's opening text to
the prompt (ctx.assistant_prefill) and the parser starts as if the model had written it;
for `none` no calls are parsed. A response with at least one call that ended with valid
JSON-object arguments finishes with reason "tool_calls" (a cut-off call keeps "length", a
malformed one leaves "stop"); whitespace around calls is not content (toolfmt/turn.py).
With parallel_tool_calls false the turn ends after the first valid call: generation is
cancelled (reason "single_tool_call") and the finish reason is "tool_calls".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Literal

from pydantic import Field

from pipeserve.events import ContentDelta, Event, Finish, TokenText, Usage
from pipeserve.stages.base import BuildEnv, RequestContext, StageParams, register_stage
from pipeserve.stages.thinking import THINK_CLOSE_KEY
from pipeserve.stages.toolfmt import DEFAULTS
from pipeserve.stages.toolfmt.base import CallSink, ToolFormat
from pipeserve.stages.toolfmt.glm_format import GlmFormat
from pipeserve.stages.toolfmt.harmony_format import HarmonyFormat, load_encoding
from pipeserve.stages.toolfmt.json_format import JsonFormat
from pipeserve.stages.toolfmt.kimi_format import KimiFormat
from pipeserve.stages.toolfmt.turn import TurnShaper

_PREFILL_KEY = "tool_calls.prefill"


class ToolCallsParams(StageParams):
    format: Literal["json", "glm", "kimi", "harmony"]
    start: str | None = Field(None, description="Call open marker (default per format).")
    end: str | None = Field(None, description="Call close marker (default per format).")
    section_start: str | None = Field(None, description="kimi: opens the calls section.")
    section_end: str | None = Field(None, description="kimi: closes the calls section.")
    args_marker: str | None = Field(
        None, description="kimi: separates the call id from its arguments."
    )
    prefill_required: str | None = Field(None, description="Prompt suffix forcing some call.")
    prefill_function: str | None = Field(None, description="Prompt suffix forcing {name}.")
    reasoning_channels: list[str] = Field(
        ["analysis"], description="harmony: channels that are reasoning."
    )


class ToolCallsStage:
    def __init__(self, params: ToolCallsParams) -> None:
        base = DEFAULTS[params.format]
        chosen = {
            k: getattr(params, k)
            for k in base.__dataclass_fields__
            if getattr(params, k) is not None
        }
        self.format = params.format
        self.cfg = dataclasses.replace(base, **chosen)
        self.reasoning_channels = frozenset(params.reasoning_channels)

    def prepare(self, ctx: RequestContext) -> None:
        choice = ctx.request.tool_choice
        if choice.mode not in ("required", "function") or not ctx.request.tools:
            return
        if choice.mode == "function" and choice.name:
            prefill = self.cfg.prefill_function.replace("{name}", choice.name)
        else:
            prefill = self.cfg.prefill_required
        if not prefill:
            return
        close = ctx.scratch.get(THINK_CLOSE_KEY) if ctx.prompt_opened_thinking else None
        if close:  # leave the think block the prompt opened before forcing the call
            ctx.prompt_opened_thinking = False
        ctx.assistant_prefill += (close or "") + prefill
        ctx.scratch[_PREFILL_KEY] = prefill

    def __call__(self, events: Iterator[Event], ctx: RequestContext) -> Iterator[Event]:
        calls_enabled = ctx.request.tool_choice.mode != "none"
        if not calls_enabled and self.format != "harmony":
            yield from _as_content(events)
            return
        sink = CallSink(ctx.request.tools)
        parser = self._parser(sink, calls_enabled)
        shaper = TurnShaper(single=not ctx.request.parallel_tool_calls)
        out: list[Event] = []
        prefill = ctx.scratch.get(_PREFILL_KEY, "")
        if prefill:
            parser.prefill(prefill, out)
            yield from _shaped((e for e in out if type(e) is not ContentDelta), shaper)
            out.clear()
        finished = False
        for event in events:
            if type(event) is TokenText:
                if shaper.closed:
                    continue
                parser.feed_token(event, out)
                if out:
                    yield from _shaped(out, shaper)
                    out.clear()
                    if shaper.closed:
                        ctx.cancel("single_tool_call")
            elif type(event) is Finish:
                if not shaper.closed:
                    parser.finish(event.reason, out)
                yield from _shaped(out, shaper)
                out.clear()
                shaper.end(out)
                yield from out
                out.clear()
                finished = True
                reason = _finish_reason(event.reason, shaper)
                yield Finish(reason, event.stop_sequence) if reason != event.reason else event
            elif type(event) is Usage and parser.reasoning_tokens:
                yield dataclasses.replace(
                    event, reasoning_tokens=event.reasoning_tokens + parser.reasoning_tokens
                )
            else:
                yield from _shaped((event,), shaper)
        if not finished:
            parser.finish("cancelled", out)
            yield from _shaped(out, shaper)

    def _parser(self, sink: CallSink, calls_enabled: bool) -> ToolFormat:
        cfg = self.cfg
        if self.format == "json":
            return JsonFormat(sink, cfg.start, cfg.end)
        if self.format == "glm":
            return GlmFormat(sink, cfg.start, cfg.end)
        if self.format == "kimi":
            return KimiFormat(
                sink, cfg.start, cfg.end, cfg.section_start, cfg.section_end, cfg.args_marker
            )
        return HarmonyFormat(load_encoding(), sink, self.reasoning_channels, calls_enabled)


def _finish_reason(reason: str, shaper: TurnShaper) -> str:
    if shaper.closed and reason != "error":
        return "tool_calls"  # we cancelled after the single call ("cancelled"), or it just ended
    return "tool_calls" if reason == "stop" and shaper.valid else reason


def _shaped(events: Iterable[Event], shaper: TurnShaper) -> list[Event]:
    shaped: list[Event] = []
    for event in events:
        shaper.push(event, shaped)
    return shaped


def _as_content(events: Iterator[Event]) -> Iterator[Event]:
    for event in events:
        if type(event) is TokenText:
            if event.text:
                yield ContentDelta(event.text)
        else:
            yield event


@register_stage("tool_calls", ToolCallsParams)
def build_tool_calls(params: ToolCallsParams, env: BuildEnv) -> ToolCallsStage:
    """Parse tool calls (json | glm | kimi | harmony) out of generated tokens."""
    stage = ToolCallsStage(params)
    if params.format == "harmony" and env.runtime is not None:
        load_encoding()  # load once at build time, not on the first request
    return stage


__all__ = ["ToolCallsParams", "ToolCallsStage"]
