"""YAML loading that remembers where every value came from.

The file is composed into PyYAML nodes (which carry marks), then converted to plain
Python data while recording, for every path such as ('stages', 2, 'thinking', 'end'),
the 1-based (line, column) of the value node and, for mapping entries, of the key.
Problems are collected as `Problem`s and raised together in a `ConfigError`.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import UnionType
from typing import Any, TypeAlias, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

PathKey: TypeAlias = tuple[str | int, ...]
Position: TypeAlias = tuple[int, int]


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


def display_path(path: Path) -> str:
    """The path as a user would type it: relative to the working directory when inside it."""
    text = os.path.normpath(str(path))
    try:
        relative = os.path.relpath(os.path.abspath(text))
    except ValueError:  # another drive on Windows
        return text
    return text if relative.startswith("..") else relative


def dotted(path: PathKey) -> str:
    """('stages', 2, 'thinking', 'end') -> 'stages[2].thinking.end'."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(root)"


@dataclass
class YamlDoc:
    """Plain data of one YAML file plus the positions of its nodes."""

    file: str  # display name used in messages
    path: Path
    data: Any
    values: dict[PathKey, Position] = field(default_factory=dict)
    keys: dict[PathKey, Position] = field(default_factory=dict)

    def position(self, path: PathKey, *, prefer_key: bool = False) -> Position:
        """Position of `path`, or of the nearest enclosing node that exists.

        prefer_key points at the key of a mapping entry (unknown keys, kind names).
        A null value (e.g. `thinking:` without params) points at its key as well.
        """
        for end in range(len(path), -1, -1):
            prefix = path[:end]
            if prefix not in self.values:
                continue
            if prefix in self.keys and (prefer_key or _data_at(self.data, prefix) is None):
                return self.keys[prefix]
            return self.values[prefix]
        return (1, 1)

    def problem(self, path: PathKey, message: str, *, prefer_key: bool = False) -> Problem:
        line, col = self.position(path, prefer_key=prefer_key)
        return Problem(self.file, line, col, dotted(path), message)


def _mark(node: Node) -> Position:
    return (node.start_mark.line + 1, node.start_mark.column + 1)


class _Converter:
    """Walks a composed node tree into plain data, recording marks and duplicate keys."""

    def __init__(self, loader: yaml.SafeLoader, doc: YamlDoc) -> None:
        self.loader = loader
        self.doc = doc
        self.problems: list[Problem] = []
        self.active: set[int] = set()

    def convert(self, node: Node, path: PathKey) -> Any:
        self.doc.values[path] = _mark(node)
        if isinstance(node, ScalarNode):
            return self.loader.construct_object(node, deep=True)
        if id(node) in self.active:  # `&a [*a]`: an alias inside itself
            line, col = _mark(node)
            self.problems.append(Problem(self.doc.file, line, col, dotted(path), "recursive alias"))
            return None
        self.active.add(id(node))
        try:
            if isinstance(node, MappingNode):
                return self._mapping(node, path)
            assert isinstance(node, SequenceNode)
            return [self.convert(item, path + (i,)) for i, item in enumerate(node.value)]
        finally:
            self.active.discard(id(node))

    def _mapping(self, node: MappingNode, path: PathKey) -> dict[Any, Any]:
        self._check_duplicates(node, path)
        self.loader.flatten_mapping(node)  # resolves `<<` merge keys in place
        result: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = self.loader.construct_object(key_node, deep=True)
            if isinstance(key, (list, dict)):
                line, col = _mark(key_node)
                self.problems.append(
                    Problem(self.doc.file, line, col, dotted(path), "a mapping key must be a scalar")
                )
                continue
            self.doc.keys[path + (key,)] = _mark(key_node)
            result[key] = self.convert(value_node, path + (key,))
        return result

    def _check_duplicates(self, node: MappingNode, path: PathKey) -> None:
        seen: dict[Any, Position] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.loader.construct_object(key_node, deep=True)
            if key in seen:
                line, col = _mark(key_node)
                first = seen[key]
                self.problems.append(
                    Problem(
                        self.doc.file, line, col, dotted(path + (key,)),
                        f"duplicate key {key!r} (first defined at line {first[0]}, column {first[1]})",
                    )
                )
            else:
                seen[key] = _mark(key_node)


def load_yaml(path: Path | str, *, display: str | None = None) -> YamlDoc:
    """Read one YAML document with positions; raise ConfigError on syntax or duplicate keys."""
    path = Path(path)
    file = display or display_path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([Problem(file, 1, 1, "(file)", f"cannot read: {exc}")]) from exc
    return parse_yaml(text, file=file, path=path)


def parse_yaml(text: str, *, file: str, path: Path | None = None) -> YamlDoc:
    """Like load_yaml, for text already in memory."""
    doc = YamlDoc(file=file, path=path or Path(file), data=None)
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            raise ConfigError([Problem(file, 1, 1, "(root)", "the file is empty")])
        converter = _Converter(loader, doc)
        doc.data = converter.convert(node, ())
    except yaml.MarkedYAMLError as exc:
        raise ConfigError([_syntax_problem(file, exc)]) from exc
    except yaml.YAMLError as exc:
        raise ConfigError([Problem(file, 1, 1, "(yaml)", str(exc))]) from exc
    finally:
        loader.dispose()
    if converter.problems:
        raise ConfigError(converter.problems)
    return doc


def _syntax_problem(file: str, exc: yaml.MarkedYAMLError) -> Problem:
    mark = exc.problem_mark or exc.context_mark
    line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
    message = exc.problem or "invalid YAML"
    if exc.context:
        message += f"; {exc.context}"
        context_mark = exc.context_mark
        if context_mark and context_mark is not mark:
            message += f" (line {context_mark.line + 1}, column {context_mark.column + 1})"
    return Problem(file, line, col, "(yaml)", f"YAML syntax error: {message}")


def suggestion(word: object, choices: Iterable[str]) -> str:
    """'; did you mean 'x'?' for the closest known name, else the list of known names."""
    options = sorted(str(c) for c in choices)
    if not options:
        return ""
    close = difflib.get_close_matches(str(word), options, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f" (known: {', '.join(options)})"


def pydantic_problems(
    doc: YamlDoc, exc: ValidationError, model: type[BaseModel], prefix: PathKey = ()
) -> list[Problem]:
    """Map each pydantic error of validating the data at `prefix` back to its node."""
    problems = []
    base = _data_at(doc.data, prefix)
    if base is None and prefix:
        base = {}  # `kind:` without params was validated as {}
    for error in exc.errors(include_url=False):
        path = _data_path(base, tuple(error["loc"]))
        full = prefix + path
        if error["type"] == "extra_forbidden":
            fields = _fields_at(model, path[:-1])
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


def _data_at(data: Any, path: PathKey) -> Any:
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


def _fields_at(model: type[BaseModel], path: PathKey) -> list[str]:
    current: Any = model
    for part in path:
        current = _descend(current, part)
        if current is None:
            return []
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
