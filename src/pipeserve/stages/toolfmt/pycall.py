"""Calls written as Python call expressions: `f(a=1, b="x")`, `[f(a=1), g()]`, and
Llama 3's built-in `brave_search.call(query="...")`. Parsed with `ast` (never
evaluated): keyword arguments whose values are literals; anything else is not a call."""

from __future__ import annotations

import ast
from typing import Any


def parse_python_calls(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    """(name, arguments) of each call in `text`, None when it is not only calls."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return None
    items = node.elts if isinstance(node, ast.List) else [node]
    calls = [_call(item) for item in items]
    if not calls or any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None]


def python_list_start(body: str) -> bool | None:
    """Whether text (stripped of leading whitespace) opens a `[f(...), ...]` list of
    calls; None while a lone `[` does not tell yet."""
    if body[:1] != "[":
        return False
    rest = body[1:].lstrip()
    if not rest:
        return None
    return rest[0].isalpha() or rest[0] == "_"


def _call(node: ast.expr) -> tuple[str, dict[str, Any]] | None:
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = _name(node.func)
    if name is None:
        return None
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, SyntaxError, TypeError):
            return None
    return name, arguments


def _name(func: ast.expr) -> str | None:
    """`f` -> f; `tool.call` (Llama 3 built-ins) -> tool; `a.b` -> a.b."""
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return func.value.id if func.attr == "call" else f"{func.value.id}.{func.attr}"
    return None
