"""Structured-output request fields of the three protocols -> OutputFormat.

Chat `response_format`: {type: text | json_object | json_schema, json_schema: {name,
schema, strict}}. Responses `text.format`: the same kinds with the json_schema members
flat ({type, name, schema, strict}). Anthropic `output_format` / `output_config.format`:
{type: json_schema, schema}. Both OpenAI fields also take a grammar, in the shape of
OpenAI's custom-tool grammar format: {type: grammar, syntax: lark | regex, definition}.
A malformed field is a 400 naming it; whether the schema compiles is decided later by
the engine (also a 400 naming the field, with llguidance's reason).
"""

from __future__ import annotations

from typing import Any

from pipeserve.errors import invalid
from pipeserve.request import OutputFormat

GRAMMAR_SYNTAXES = ("lark", "regex")


def _require(condition: bool, param: str, problem: str) -> None:
    if not condition:
        raise invalid(f"Invalid value for '{param}': {problem}.", param)


def openai_output_format(raw: Any, param: str, flat: bool) -> OutputFormat | None:
    """Chat's response_format (flat=False) or Responses' text.format (flat=True)."""
    if raw is None:
        return None
    _require(isinstance(raw, dict), param, "expected an object")
    kind = raw.get("type")
    _require(isinstance(kind, str), f"{param}.type", "expected a string")
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputFormat("json_object", param=param)
    if kind == "json_schema":
        return _json_schema(
            raw if flat else raw.get("json_schema"), param if flat else f"{param}.json_schema"
        )
    if kind == "grammar":
        return _grammar(raw, param)
    raise invalid(
        f"Invalid value for '{param}.type': {kind!r} is not one of text, json_object, json_schema, grammar.",
        f"{param}.type",
    )


def _json_schema(spec: Any, param: str) -> OutputFormat:
    _require(isinstance(spec, dict), param, "expected an object with 'name' and 'schema'")
    name = spec.get("name")
    _require(name is None or isinstance(name, str), f"{param}.name", "expected a string")
    schema = spec.get("schema", {"type": "object"})
    _require(isinstance(schema, dict), f"{param}.schema", "expected a JSON Schema object")
    strict = spec.get("strict")
    _require(strict is None or isinstance(strict, bool), f"{param}.strict", "expected a boolean")
    return OutputFormat("json_schema", schema, param=f"{param}.schema", name=name)


def _grammar(raw: dict[str, Any], param: str) -> OutputFormat:
    syntax: Any = raw.get("syntax")
    _require(syntax in GRAMMAR_SYNTAXES, f"{param}.syntax", "expected 'lark' or 'regex'")
    definition = raw.get("definition")
    _require(
        isinstance(definition, str) and bool(definition),
        f"{param}.definition",
        "expected a non-empty string",
    )
    return OutputFormat(syntax, definition, param=f"{param}.definition")


def anthropic_output_format(raw: Any, param: str) -> OutputFormat | None:
    """Anthropic's output_format / output_config.format: {type: json_schema, schema}."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise invalid(f"{param}: expected an object", param)
    if raw.get("type") != "json_schema":
        raise invalid(f"{param}.type: only 'json_schema' is supported", f"{param}.type")
    schema = raw.get("schema")
    if not isinstance(schema, dict):
        raise invalid(f"{param}.schema: expected a JSON Schema object", f"{param}.schema")
    return OutputFormat("json_schema", schema, param=f"{param}.schema")
