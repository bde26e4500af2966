"""Tool-call grammars, derived from a format's declared call layout.

Forced calls (tool_choice `required`: any of the tools, or a named function): the model
must write exactly one call in its family's format, with arguments valid against the
tool's JSON schema; the assistant prefill that opens the call is fed to the matcher
before decoding.

Strict tools under tool_choice `auto`: the model may answer in text, call any tool, or
both (text, then calls); a call to a strict tool has arguments valid against its
schema, any other call has a JSON object (the format's own key/value pairs for GLM).
The format declares where calls sit (CallsLayout): free text never contains the call
trigger, so writing the trigger commits to a call. A trigger that is a special token
cannot occur in free text anyway; a plain-text trigger ends a lazy lexeme (the
shortest text ending in it) and the text-only answer excludes it by regex negation.

A format declares the text around a call (CallFrame: prefix + JSON arguments + suffix,
or PairFrame: key/value pairs as GLM writes them); the markers in that text become
Lark pieces (stages/grammar_plan.py), so nothing here knows a family.

With a client's output format as well (an agent with tools and a typed final answer),
the answer is either that format or calls, so neither request field is ignored.
"""

from __future__ import annotations

import json
from typing import Any

from pipeserve.constraint import Envelope, GrammarPlan, Tokens
from pipeserve.engine.sampling.grammar import GrammarError
from pipeserve.request import OutputFormat, ToolSpec
from pipeserve.stages.grammar_plan import (
    ANY_TEXT,
    answer_grammar,
    envelope_lark,
    framed_answer,
    free_text_until,
    lark_string,
    marker_lark,
    marker_pieces,
    regex_escape,
    styled_schema,
)
from pipeserve.stages.toolfmt.coerce import schema_types
from pipeserve.stages.toolfmt.registry import CallsLayout, PairFrame, ToolFormatParams

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def forced_call_plan(params: ToolFormatParams, tools: list[ToolSpec], forced: str) -> GrammarPlan:
    """The plan for a call to one of `tools` (one tool for a named function)."""

    def build(tokens: Tokens) -> str:
        rules: list[str] = []
        for i, tool in enumerate(tools):
            rules += call_rules(params, tool.name, tool.parameters, f"call{i}", tokens)
        start = "start: " + " | ".join(f"call{i}" for i in range(len(tools)))
        return json.dumps({"grammars": [{"lark_grammar": "\n".join([start, *rules]) + "\n"}]})

    return GrammarPlan(build, forced=forced, param="tool_choice", optional=True)


def auto_call_plan(
    params: ToolFormatParams,
    tools: list[ToolSpec],
    envelope: Envelope | None,
    opened: bool,
    single: bool,
    fmt: OutputFormat | None = None,
) -> GrammarPlan | None:
    """Free text and calls (tool_choice auto) with strict tools' arguments enforced;
    None when the format declares no calls layout. `single`: at most one call. With a
    client's output format `fmt`, the answer is that format or calls (no text)."""
    layout = params.calls_layout()
    if layout is None:
        return None

    def build(tokens: Tokens) -> str:
        check_strict_schemas(tools)
        rules: list[str] = []
        for i, tool in enumerate(tools):
            schema = tool.parameters if tool.strict else ANY_OBJECT
            rules += call_rules(params, tool.name, schema, f"call{i}", tokens, layout.trigger)
        rules.append("tail: " + " | ".join(f"call{i}" for i in range(len(tools))))
        if fmt is None:
            answer, extra = auto_answer(tokens, layout, envelope, single)
        else:
            answer, extra = format_or_calls(tokens, layout, envelope, single)
        rules += extra
        lark = envelope_lark(tokens, envelope, opened, answer, tuple(rules))
        grammars: list[dict[str, Any]] = [{"lark_grammar": lark}]
        if fmt is not None:
            grammars.append(answer_grammar(fmt))
        return json.dumps({"grammars": grammars}, ensure_ascii=False)

    # Optional (an engine that cannot enforce answers unconstrained, as before) unless the
    # client asked for an output format, which such an engine refuses.
    if fmt is not None:
        return GrammarPlan(build, param=fmt.param)
    return GrammarPlan(build, param="tools", optional=True)


def auto_answer(
    tokens: Tokens, layout: CallsLayout, envelope: Envelope | None, single: bool
) -> tuple[str, list[str]]:
    """(the answer's Lark, the rules it adds): free text then calls, or (Harmony) a
    call instead of the text. Each call is `trigger tail`; `tail` is any tool's call
    after the trigger."""
    more = more_calls(tokens, layout, single)
    if not layout.after_text:
        text = framed_answer(tokens, envelope, "TEXT")
        return f"({text} | {first_call(tokens, layout)}{more})", [f"TEXT: {ANY_TEXT}"]
    pieces = marker_pieces(tokens, layout.trigger)
    if not pieces or pieces[0][0]:  # a special-token trigger never occurs in free text
        calls = f"{first_call(tokens, layout)}{more}"
        return framed_answer(tokens, envelope, f"TEXT ({calls})?"), [f"TEXT: {ANY_TEXT}"]
    first = regex_escape(pieces[0][1])
    rest = " ".join(p if special else lark_string(p) for special, p in pieces[1:])
    rules = [
        f"TEXT: {ANY_TEXT} & ~/(?s:.*){first}(?s:.*)/",  # text alone never holds the trigger
        f"head[lazy]: /(?s:.*){first}/",  # text up to the first trigger
    ]
    calls = " ".join(p for p in ("head", rest, f"tail{more}") if p)
    return framed_answer(tokens, envelope, f"(TEXT | {calls})"), rules


def format_or_calls(
    tokens: Tokens, layout: CallsLayout, envelope: Envelope | None, single: bool
) -> tuple[str, list[str]]:
    """(the answer's Lark, its rules) when the client also sent an output format: the
    answer follows it (`@answer`, in the envelope's answer frame), or the model calls."""
    calls = f"{first_call(tokens, layout)}{more_calls(tokens, layout, single)}"
    if not layout.after_text:
        return f"({framed_answer(tokens, envelope, '@answer')} | {calls})", []
    return framed_answer(tokens, envelope, f"(@answer | {calls})"), []


def first_call(tokens: Tokens, layout: CallsLayout) -> str:
    return " ".join(p for p in (marker_lark(tokens, layout.trigger), "tail") if p)


def more_calls(tokens: Tokens, layout: CallsLayout, single: bool) -> str:
    """Lark for the calls after the first: none, or any number after the separator."""
    if single or layout.single:
        return ""
    again = [marker_lark(tokens, layout.separator), first_call(tokens, layout)]
    return f" ({' '.join(p for p in again if p)})*"


def check_strict_schemas(tools: list[ToolSpec]) -> None:
    """A strict tool's schema must compile on its own: the error names the tool."""
    import llguidance

    for tool in tools:
        if not tool.strict:
            continue
        grammar = json.dumps({"grammars": [{"json_schema": styled_schema(tool.parameters)}]})
        failed, problems = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if failed:
            reason = " ".join(problems[0].split())[:300]
            message = f"the parameters schema of strict tool {tool.name!r}: {reason}"
            raise GrammarError(message, param="tools")


def call_rules(
    params: ToolFormatParams,
    name: str,
    schema: Any,
    rule: str,
    tokens: Tokens,
    drop: str = "",
) -> list[str]:
    """Lark rules: `rule` is one call to `name` with arguments valid against `schema`,
    without the leading `drop` text (a trigger written before)."""
    frame = params.call_frame(name)
    if frame is not None:
        prefix = marker_lark(tokens, _after(frame.prefix, drop))
        suffix = marker_lark(tokens, frame.suffix)
        return [f"{rule}: {prefix} {json_rule(schema)} {suffix}".replace(":  ", ": ").rstrip()]
    pairs = params.pair_frame(name)
    if pairs is None:
        raise ValueError(f"tool format {params.format!r} declares no call layout to force")
    return pair_rules(pairs, schema, rule, tokens, drop)


def _after(text: str, drop: str) -> str:
    if not text.startswith(drop):
        raise ValueError(f"a call starts {text!r}, not with its trigger {drop!r}")
    return text[len(drop) :]


def json_rule(schema: Any) -> str:
    return "%json " + json.dumps(styled_schema(schema), ensure_ascii=False)


def pair_rules(
    frame: PairFrame, schema: Any, rule: str, tokens: Tokens, drop: str = ""
) -> list[str]:
    """prefix, then each declared property as a key/value pair (required ones always,
    optional ones maybe, in declaration order), then suffix. A schema that declares no
    properties takes any pairs."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    required = set(schema.get("required", ())) if isinstance(schema, dict) else set()
    sep = marker_lark(tokens, frame.separator)
    body = [marker_lark(tokens, _after(frame.prefix, drop))]
    if not isinstance(props, dict) or not props:
        body += [f"{rule}_any*", marker_lark(tokens, frame.suffix)]
        return [f"{rule}: {' '.join(p for p in body if p)}", *any_pair_rules(frame, rule, tokens)]
    rules: list[str] = []
    for j, (key, prop) in enumerate(props.items()):
        name = f"{rule}_p{j}"
        key_text = marker_lark(tokens, frame.key_open + key + frame.key_close)
        value, extra = pair_value(frame, prop, f"{name}_v", tokens)
        rules += extra
        close = "" if extra else marker_lark(tokens, frame.value_close)  # extra ends with it
        opening = marker_lark(tokens, frame.value_open)
        rules.append(f"{name}: {key_text} {sep} {opening} {value} {close} {sep}")
        body.append(name if key in required else f"{name}?")
    body.append(marker_lark(tokens, frame.suffix))
    return [f"{rule}: {' '.join(p for p in body if p)}", *rules]


def any_pair_rules(frame: PairFrame, rule: str, tokens: Tokens) -> list[str]:
    """`{rule}_any`: one key/value pair with any key and any plain-text value."""
    sep = marker_lark(tokens, frame.separator)
    opening = marker_lark(tokens, frame.value_open)
    key, value = f"{rule}_key", f"{rule}_value"
    rules = [
        *free_text_until(tokens, frame.key_close, key),
        *free_text_until(tokens, frame.value_close, value),
    ]
    start = marker_lark(tokens, frame.key_open)
    return [f"{rule}_any: {start} {key} {sep} {opening} {value} {sep}", *rules]


def pair_value(frame: PairFrame, prop: Any, rule: str, tokens: Tokens) -> tuple[str, list[str]]:
    """(Lark for one value, extra rules): plain text for strings, JSON otherwise.

    A free string value runs to the value's close marker: then the extra rules are
    returned and already include that marker.
    """
    if schema_types(prop) != frozenset(("string",)) or not isinstance(prop, dict):
        return json_rule(prop if prop is not None else {}), []
    if isinstance(prop.get("enum"), list):
        return "(" + " | ".join(lark_string(str(v)) for v in prop["enum"]) + ")", []
    limit = prop.get("maxLength")
    pattern = prop.get("pattern")
    if isinstance(pattern, str):
        return f"/{_anchored(pattern)}/", []
    if isinstance(limit, int):
        return f"/[^<]{{0,{limit}}}/", []
    return rule, free_text_until(tokens, frame.value_close, rule)


def _anchored(pattern: str) -> str:
    """A JSON-schema pattern (a search) as a whole-value regex."""
    import llguidance

    inner = pattern
    head = inner.startswith("^")
    tail = inner.endswith("$") and not inner.endswith("\\$")
    inner = inner[1 if head else 0 : -1 if tail else None]
    if not head:
        inner = "(?s:.*)" + f"(?:{inner})"
    if not tail:
        inner = f"(?:{inner})" + "(?s:.*)"
    return llguidance.regex_to_lark(inner, "dw")


__all__ = ["auto_call_plan", "forced_call_plan"]
