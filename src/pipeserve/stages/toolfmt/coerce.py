"""Coerce tool-call argument values to the types of the tool's JSON schema.

Models often write `"3"` for an integer, `"true"` for a boolean or a JSON text for an
object. Coercion only converts when the schema rules the written type out, so a value
that already fits (or a schema we do not understand) is left exactly as written.
"""

from __future__ import annotations

import json
import re
from typing import Any

JsonTypes = frozenset[str]

_INT = re.compile(r"[-+]?\d+")
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_NULLS = frozenset({"null", "none"})


def schema_types(schema: Any) -> JsonTypes | None:
    """The JSON types a schema allows; None when unknown (no coercion then)."""
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if isinstance(kind, str):
        return frozenset((kind,))
    if isinstance(kind, list):
        return frozenset(k for k in kind if isinstance(k, str))
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list):
            found: set[str] = set()
            for branch in branches:
                types = schema_types(branch)
                if types is None:
                    return None
                found |= types
            return frozenset(found)
    if "properties" in schema:
        return frozenset(("object",))
    if "items" in schema:
        return frozenset(("array",))
    return None


def property_schema(schema: Any, key: str) -> Any:
    """The schema of member `key` of an object schema (None when unconstrained)."""
    if not isinstance(schema, dict):
        return None
    props = schema.get("properties")
    if isinstance(props, dict) and key in props:
        return props[key]
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, dict) else None


def items_schema(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return None
    items = schema.get("items")
    return items if isinstance(items, dict) else None


def _from_text(text: str, types: JsonTypes) -> Any:
    """A string the schema does not allow, read as the first allowed type that parses."""
    s = text.strip()
    if "integer" in types and _INT.fullmatch(s):
        return int(s)
    if "number" in types and _NUMBER.fullmatch(s):
        number = float(s)
        return (
            int(number) if number.is_integer() and "." not in s and "e" not in s.lower() else number
        )
    if "boolean" in types and s.lower() in ("true", "false"):
        return s.lower() == "true"
    if "null" in types and s.lower() in _NULLS:
        return None
    if ("object" in types or "array" in types) and s[:1] in ("{", "["):
        try:
            value = json.loads(s, strict=False)
        except ValueError:
            return text
        if (isinstance(value, dict) and "object" in types) or (
            isinstance(value, list) and "array" in types
        ):
            return value
    return text


def coerce(value: Any, schema: Any) -> Any:
    """`value` converted to what `schema` allows, recursively; unchanged when it fits."""
    types = schema_types(schema)
    if types is not None and types:
        if isinstance(value, str) and "string" not in types:
            value = _from_text(value, types)
        elif isinstance(value, bool):
            if "boolean" not in types and "string" in types:
                return "true" if value else "false"
        elif isinstance(value, (int, float)):
            value = _coerce_number(value, types)
    if isinstance(value, dict):
        return {k: coerce(v, property_schema(schema, k)) for k, v in value.items()}
    if isinstance(value, list):
        inner = items_schema(schema)
        return [coerce(v, inner) for v in value] if inner is not None else value
    return value


def _coerce_number(value: int | float, types: JsonTypes) -> Any:
    if (
        "integer" in types
        and "number" not in types
        and isinstance(value, float)
        and value.is_integer()
    ):
        return int(value)
    if "string" in types and not types & {"integer", "number"}:
        return json.dumps(value)
    return value


def coerce_text_value(text: str, schema: Any) -> Any:
    """A value written as plain text (GLM `<arg_value>`): JSON when that fits the schema."""
    types = schema_types(schema)
    if types is not None and types == frozenset(("string",)):
        return text
    stripped = text.strip()
    try:
        value = json.loads(stripped, strict=False)
    except ValueError:
        value = text
    if types is not None and "string" in types and not isinstance(value, str):
        # A string parameter whose text happens to look like JSON stays the text.
        allowed = {"integer", "number", "boolean", "null", "object", "array"} & types
        if not any(
            _json_type(value) == t or (t == "number" and _json_type(value) == "integer")
            for t in allowed
        ):
            return text
    return coerce(value, schema)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def dumps(value: Any) -> str:
    """The JSON text we emit for a value (non-ASCII kept as is)."""
    return json.dumps(value, ensure_ascii=False)
