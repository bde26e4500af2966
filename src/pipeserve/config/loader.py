"""YAML loading that remembers where every value came from.

The file is composed into PyYAML nodes (which carry marks), then converted to plain
Python data while recording, for every path such as ('stages', 2, 'thinking', 'end'),
the 1-based (line, column) of the value node and, for mapping entries, of the key.
Problems are collected as `Problem`s and raised together in a `ConfigError` (both in
pipeserve.config.problems).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from pipeserve.config.problems import ConfigError, PathKey, Problem, data_at

Position: TypeAlias = tuple[int, int]


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
    text: str = ""  # the file as read (the console shows the config the server runs)

    def position(self, path: PathKey, *, prefer_key: bool = False) -> Position:
        """Position of `path`, or of the nearest enclosing node that exists.

        prefer_key points at the key of a mapping entry (unknown keys, kind names).
        A null value (e.g. `thinking:` without params) points at its key as well.
        """
        for end in range(len(path), -1, -1):
            prefix = path[:end]
            if prefix not in self.values:
                continue
            if prefix in self.keys and (prefer_key or data_at(self.data, prefix) is None):
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
                    Problem(
                        self.doc.file, line, col, dotted(path), "a mapping key must be a scalar"
                    )
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
                        self.doc.file,
                        line,
                        col,
                        dotted(path + (key,)),
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
    doc = YamlDoc(file=file, path=path or Path(file), data=None, text=text)
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
