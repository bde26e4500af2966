"""`tool_calls`: turn generated tokens into content and tool calls, in a registered format.

Each format (stages/toolfmt/<name>_format.py) brings its own params model: its markers
and the tool_choice prefills default per format and can be overridden in YAML.
For tool_choice `required` / `function`, prepare() appends the format's opening text to
the prompt (ctx.assistant_prefill) and the parser starts as if the model had written it;
for `none` no calls are parsed. Under `auto` with strict tools, a grammar lets the model
write text and calls while enforcing strict tools' arguments (toolfmt/call_grammar.py).
A response with at least one call that ended with valid
JSON-object arguments finishes with reason "tool_calls" (a cut-off call keeps "length", a
malformed one leaves "stop"); whitespace around calls is not content (toolfmt/turn.py).
With parallel_tool_calls false the turn ends after the first valid call: generation is
cancelled (reason "single_tool_call") and the finish reason is "tool_calls".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Annotated, Any, ClassVar, Union

from pydantic import (
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    RootModel,
    SerializeAsAny,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from pipeserve.context import ThinkMarkers
from pipeserve.events import ContentDelta, Event, Finish, FinishReason, TokenText, Usage
from pipeserve.stages.base import BuildEnv, RequestContext, register_stage
from pipeserve.stages.toolfmt.base import CallSink
from pipeserve.stages.toolfmt.call_grammar import auto_call_plan, forced_call_plan
from pipeserve.stages.toolfmt.registry import (
    TOOL_FORMATS,
    ToolFormatParams,
    ToolFormatSpec,
    load_builtin_formats,
)
from pipeserve.stages.toolfmt.turn import TurnShaper

load_builtin_formats()


class ToolCallsParams(RootModel[SerializeAsAny[ToolFormatParams]]):
    """The params of the format named by `format`: a union over the registered formats.

    Built from the registry when validating (and for the JSON schema), so a format
    registered later is accepted without changing this class.
    """

    model_config = ConfigDict(frozen=True)

    @field_validator("root", mode="wrap")
    @classmethod
    def _by_format(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if not isinstance(value, dict):
            return handler(value)  # an already-built format params model, or a type error
        name = value.get("format")
        spec = TOOL_FORMATS.get(name) if isinstance(name, str) else None
        if spec is None:
            raise _format_error(name, "format" in value)
        return spec.params_model.model_validate(value)

    @classmethod
    def variant_for(cls, data: Any) -> type[ToolFormatParams] | None:
        """The format params model that `data` selects (for config error hints)."""
        name = data.get("format") if isinstance(data, dict) else None
        spec = TOOL_FORMATS.get(name) if isinstance(name, str) else None
        return spec.params_model if spec else None

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        models = tuple(TOOL_FORMATS[name].params_model for name in sorted(TOOL_FORMATS))
        # Built at run time from the registry, which a static checker cannot follow.
        union: Any = Annotated[Union[models], Field(discriminator="format")]  # noqa: UP007
        return handler(TypeAdapter(union).core_schema)


def _format_error(name: object, given: bool) -> ValidationError:
    """The error a Literal of the registered names would give (config adds did-you-mean)."""
    names = sorted(TOOL_FORMATS)
    expected = ", ".join(repr(n) for n in names[:-1]) + f" or {names[-1]!r}"
    if not given:
        error: Any = {"type": "missing", "loc": ("format",), "input": {}}
    else:
        ctx = {"expected": expected}
        error = {"type": "literal_error", "loc": ("format",), "input": name, "ctx": ctx}
    return ValidationError.from_exception_data("ToolCallsParams", [error])


class ToolCallsStage:
    parses_output: ClassVar[bool] = True  # skipped for raw prompts (stages/base.py Chain)

    def __init__(self, params: ToolCallsParams | ToolFormatParams) -> None:
        chosen = params.root if isinstance(params, ToolCallsParams) else params
        self.params = chosen
        self.spec: ToolFormatSpec[Any] = TOOL_FORMATS[chosen.format]
        # Formats that read reasoning channels (harmony) also produce thinking.
        thinks = bool(getattr(chosen, "reasoning_channels", None))
        self.capabilities = frozenset({"tools", "thinking"} if thinks else {"tools"})

    def prepare(self, ctx: RequestContext) -> None:
        envelope = self.params.envelope()
        if envelope is not None:  # the format frames reasoning and answer (Harmony)
            ctx.envelope = envelope
            if envelope.reasoning_open and ctx.think_markers is None:  # for thinking budgets
                close = envelope.reasoning_close + envelope.answer_open
                ctx.think_markers = ThinkMarkers(
                    envelope.reasoning_open, envelope.reasoning_close, close
                )
        choice = ctx.request.tool_choice
        if choice.mode == "auto":
            self._strict_auto(ctx)
        if choice.mode not in ("required", "function") or not ctx.request.tools:
            return
        prefill = self.params.forced_prefill(choice.name if choice.mode == "function" else None)
        if not prefill:
            return
        close = ctx.think_close if ctx.prompt_opened_thinking else ""
        if close:  # leave the think block the prompt opened before forcing the call
            ctx.prompt_opened_thinking = False
        ctx.assistant_prefill += close + prefill
        ctx.forced_call = prefill
        tools = [t for t in ctx.request.tools if choice.mode != "function" or t.name == choice.name]
        ctx.grammar_plan = forced_call_plan(self.params, tools, prefill)

    def _strict_auto(self, ctx: RequestContext) -> None:
        """Strict tools under tool_choice auto: text and calls, strict arguments enforced.
        With a client's output format (strict tools or not), the answer follows it or the
        model calls: without this the format's grammar would leave no room for calls."""
        request = ctx.request
        if not request.tools:
            return
        if not any(t.strict for t in request.tools) and request.output_format is None:
            return
        ctx.grammar_plan = auto_call_plan(
            self.params,
            request.tools,
            ctx.envelope,
            ctx.prompt_opened_thinking,
            single=not request.parallel_tool_calls,
            fmt=request.output_format,
        )

    def __call__(self, events: Iterator[Event], ctx: RequestContext) -> Iterator[Event]:
        calls_enabled = ctx.request.tool_choice.mode != "none"
        if not calls_enabled and not self.spec.parses_without_calls:
            yield from _as_content(events)
            return
        sink = CallSink(ctx.request.tools)
        parser = self.spec.factory(self.params, sink, calls_enabled)
        shaper = TurnShaper(single=not ctx.request.parallel_tool_calls)
        out: list[Event] = []
        if ctx.forced_call:
            parser.prefill(ctx.forced_call, out)
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


def _finish_reason(reason: FinishReason, shaper: TurnShaper) -> FinishReason:
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
    """Parse tool calls (in a registered format) out of generated tokens."""
    stage = ToolCallsStage(params)
    if stage.spec.warm_up is not None and env.runtime is not None:
        stage.spec.warm_up()  # once at build time, not on the first request
    return stage


__all__ = ["ToolCallsParams", "ToolCallsStage"]
