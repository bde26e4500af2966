"""The grammar of a forced tool call, derived from a format's declared call layout.

tool_choice `required` (any of the tools) or a named function: the model must write
exactly one call in its family's format, with arguments valid against the tool's JSON
schema. A format declares the text around a call (CallFrame: prefix + JSON arguments +
suffix, or PairFrame: key/value pairs as GLM writes them); the markers in that text
become Lark pieces (stages/grammar_plan.py), so nothing here knows a family. The
assistant prefill that opens the call is fed to the matcher before decoding.
"""

from __future__ import annotations

import json
from typing import Any

from pipeserve.constraint import GrammarPlan, Tokens
from pipeserve.request import ToolSpec
from pipeserve.stages.grammar_plan import free_text_until, lark_string, marker_lark, styled_schema
from pipeserve.stages.toolfmt.coerce import schema_types
from pipeserve.stages.toolfmt.registry import PairFrame, ToolFormatParams


def forced_call_plan(params: ToolFormatParams, tools: list[ToolSpec], forced: str) -> GrammarPlan:
    """The plan for a call to one of `tools` (one tool for a named function)."""

    def build(tokens: Tokens) -> str:
        rules: list[str] = []
        for i, tool in enumerate(tools):
            rules += call_rules(params, tool, f"call{i}", tokens)
        start = "start: " + " | ".join(f"call{i}" for i in range(len(tools)))
        return json.dumps({"grammars": [{"lark_grammar": "\n".join([start, *rules]) + "\n"}]})

    return GrammarPlan(build, forced=forced, param="tool_choice", optional=True)


def call_rules(params: ToolFormatParams, tool: ToolSpec, rule: str, tokens: Tokens) -> list[str]:
    frame = params.call_frame(tool.name)
    if frame is not None:
        args = json_rule(tool.parameters)
        prefix, suffix = marker_lark(tokens, frame.prefix), marker_lark(tokens, frame.suffix)
        return [f"{rule}: {prefix} {args} {suffix}".rstrip()]
    pairs = params.pair_frame(tool.name)
    if pairs is None:
        raise ValueError(f"tool format {params.format!r} declares no call layout to force")
    return pair_rules(pairs, tool.parameters, rule, tokens)


def json_rule(schema: Any) -> str:
    return "%json " + json.dumps(styled_schema(schema), ensure_ascii=False)


def pair_rules(frame: PairFrame, schema: Any, rule: str, tokens: Tokens) -> list[str]:
    """prefix, then each declared property as a key/value pair (required ones always,
    optional ones maybe, in declaration order), then suffix."""
    props = schema.get("properties", {}) if isinstance(schema, dict) else {}
    required = set(schema.get("required", ())) if isinstance(schema, dict) else set()
    sep = marker_lark(tokens, frame.separator)
    rules: list[str] = []
    body = [marker_lark(tokens, frame.prefix)]
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


__all__ = ["forced_call_plan"]
