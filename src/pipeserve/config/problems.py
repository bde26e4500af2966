"""Positioned config problems: Problem, ConfigError, and the mapping of pydantic errors to them.

`pydantic_problems` turns each pydantic error back into the YAML node it came from, with a
"did you mean" hint for unknown keys and literal values. This module is the base of the
config package: it imports nothing from it (a YAML document is any `PositionedDoc`).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from types import UnionType
from typing import (
    Any,
    Protocol,
    TypeAlias,
    Union,
    get_args,
    get_origin,
    runtime_checkable,
)

from pydantic import BaseModel, ValidationError

PathKey: TypeAlias = tuple[str | int, ...]


@dataclass(frozen=True, order=True)
class Problem:
    """One positioned problem: `FILE:LINE:COL: dotted.path: message`."""

    file: str
    line: int
    col: int
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}: {self.path}: {self.message}"


def sort_problems(problems: Iterable[Problem]) -> list[Problem]:
    """By file, then position; problems at one position keep their order."""
    return sorted(problems, key=lambda p: (p.file, p.line, p.col))


class ConfigError(Exception):
    """Raised with every problem found; str() is one positioned message per line, sorted."""

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems = sort_problems(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


def suggestion(word: object, choices: Iterable[str]) -> str:
    """'; did you mean 'x'?' for the closest known name, else the list of known names."""
    options = sorted(str(c) for c in choices)
    if not options:
        return ""
    close = difflib.get_close_matches(str(word), options, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f" (known: {', '.join(options)})"


class PositionedDoc(Protocol):
    """A parsed YAML document that knows where each value came from (config.loader.YamlDoc)."""

    data: Any

    def problem(self, path: PathKey, message: str, *, prefer_key: bool = False) -> Problem: ...


def pydantic_problems(
    doc: PositionedDoc, exc: ValidationError, model: type[BaseModel], prefix: PathKey = ()
) -> list[Problem]:
    """Map each pydantic error of validating the data at `prefix` back to its node."""
    problems = []
    base = data_at(doc.data, prefix)
    if base is None and prefix:
        base = {}  # `kind:` without params was validated as {}
    for error in exc.errors(include_url=False):
        path = _data_path(base, tuple(error["loc"]))
        full = prefix + path
        if error["type"] == "extra_forbidden":
            fields = _fields_at(model, path[:-1], base)
            message = f"unknown key {path[-1]!r}{suggestion(path[-1], fields)}"
            problems.append(doc.problem(full, message, prefer_key=True))
        else:
            problems.append(doc.problem(full, _message(error)))
    return problems


def _message(error: Any) -> str:
    message = str(error["msg"])
    if error["type"] in ("literal_error", "enum") and isinstance(error.get("input"), str):
        choices = re.findall(r"'([^']*)'", str(error.get("ctx", {}).get("expected", "")))
        close = difflib.get_close_matches(error["input"], choices, n=1, cutoff=0.6)
        return f"{message}; did you mean {close[0]!r}?" if close else message
    if error["type"].endswith("_type") and "input" in error:
        return f"{message}, got {_describe(error['input'])}"
    return message


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, (dict, list)):
        return "a mapping" if isinstance(value, dict) else "a list"
    return f"{type(value).__name__} {value!r}"


def data_at(data: Any, path: PathKey) -> Any:
    """The value at `path` in plain data, or None when it does not exist."""
    for part in path:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return None
    return data


def _data_path(data: Any, loc: PathKey) -> PathKey:
    """Follow loc through the data, dropping pydantic's union/validator tags.

    Only the last loc element may name a key that is not in the data (a missing or
    an unknown key); any other element that does not index the data is a tag such as
    'function-after[...]' or a union member's name.
    """
    path: list[str | int] = []
    for i, part in enumerate(loc):
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data):
            data = data[part]
        elif isinstance(data, dict) and i == len(loc) - 1:
            data = None
        else:
            continue
        path.append(part)
    return tuple(path)


@runtime_checkable
class Variants(Protocol):
    """A model that validates as one of several models, chosen by the data (a union)."""

    @classmethod
    def variant_for(cls, data: Any) -> type[BaseModel] | None: ...


def _fields_at(model: type[BaseModel], path: PathKey, data: Any) -> list[str]:
    current: Any = model
    for part in path:
        current = _descend(current, part)
        data = data_at(data, (part,))
        if current is None:
            return []
    if isinstance(current, Variants):
        current = current.variant_for(data)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return []


def _descend(tp: Any, part: str | int) -> Any:
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        field_info = tp.model_fields.get(part) if isinstance(part, str) else None
        return field_info.annotation if field_info else None
    origin = get_origin(tp)
    if origin in (Union, UnionType):
        for arg in get_args(tp):
            found = _descend(arg, part) if arg is not type(None) else None
            if found is not None:
                return found
        return None
    args = get_args(tp)
    if origin in (list, tuple, set, frozenset) and isinstance(part, int) and args:
        return args[0]
    if origin is dict and len(args) == 2:
        return args[1]
    return None
