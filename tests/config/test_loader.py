"""YAML loading: positions of values and keys, syntax errors, duplicate keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeserve.config.loader import dotted, load_yaml, parse_yaml
from pipeserve.config.problems import ConfigError, Problem

TEXT = """\
family: qwen3
stages:
  - generate: {}
  - thinking:
      start: "<think>"
      end: "</think>"
"""


def test_positions_of_values_and_keys() -> None:
    doc = parse_yaml(TEXT, file="p.yaml")
    assert doc.data == {
        "family": "qwen3",
        "stages": [{"generate": {}}, {"thinking": {"start": "<think>", "end": "</think>"}}],
    }
    assert doc.values[("family",)] == (1, 9)
    assert doc.keys[("family",)] == (1, 1)
    assert doc.values[("stages", 0)] == (3, 5)
    assert doc.values[("stages", 0, "generate")] == (3, 15)
    assert doc.keys[("stages", 1, "thinking")] == (4, 5)
    assert doc.values[("stages", 1, "thinking")] == (5, 7)
    assert doc.values[("stages", 1, "thinking", "end")] == (6, 12)
    assert doc.keys[("stages", 1, "thinking", "end")] == (6, 7)


def test_missing_path_points_at_the_enclosing_mapping() -> None:
    doc = parse_yaml(TEXT, file="p.yaml")
    assert doc.position(("stages", 0, "generate", "nothing")) == (3, 15)
    assert doc.position(("stages", 1, "thinking", "nothing")) == (5, 7)
    assert doc.position(("stages", 1, "thinking", "end"), prefer_key=True) == (6, 7)


def test_null_value_points_at_its_key() -> None:
    doc = parse_yaml("stages:\n  - stop_sequences:\n  - generate: null\n", file="p.yaml")
    assert doc.data == {"stages": [{"stop_sequences": None}, {"generate": None}]}
    assert doc.position(("stages", 0, "stop_sequences", "x")) == (2, 5)
    assert doc.position(("stages", 1, "generate")) == (3, 5)


def test_syntax_error_has_file_line_column() -> None:
    with pytest.raises(ConfigError) as info:
        parse_yaml("family: qwen3\nstages:\n\t- generate: {}\n", file="pipelines/q.yaml")
    (problem,) = info.value.problems
    assert (problem.file, problem.line, problem.col) == ("pipelines/q.yaml", 3, 1)
    assert "found character '\\t' that cannot start any token" in problem.message
    assert str(info.value).startswith("pipelines/q.yaml:3:1: (yaml): YAML syntax error: ")


def test_unclosed_flow_mapping_names_the_opening() -> None:
    with pytest.raises(ConfigError) as info:
        parse_yaml("stages:\n  - thinking: {start: a\n  - generate: {}\n", file="q.yaml")
    (problem,) = info.value.problems
    assert (problem.line, problem.col) == (3, 13)  # the ":" after "generate"
    assert "while parsing a flow mapping (line 2, column 15)" in problem.message


def test_duplicate_key_is_an_error_with_both_positions() -> None:
    text = "family: a\nstages:\n  - thinking: {start: x, start: y}\nfamily: b\n"
    with pytest.raises(ConfigError) as info:
        parse_yaml(text, file="q.yaml")
    assert [str(p) for p in info.value.problems] == [
        "q.yaml:3:26: stages[0].thinking.start: duplicate key 'start' (first defined at line 3, column 16)",
        "q.yaml:4:1: family: duplicate key 'family' (first defined at line 1, column 1)",
    ]


def test_anchors_and_merge_keys() -> None:
    text = "base: &b {start: a, end: b}\nother:\n  <<: *b\n  end: c\n"
    doc = parse_yaml(text, file="q.yaml")
    assert doc.data["other"] == {"start": "a", "end": "c"}
    assert doc.values[("other", "end")] == (4, 8)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing\n")
    with pytest.raises(ConfigError) as info:
        load_yaml(path, display="empty.yaml")
    assert str(info.value) == "empty.yaml:1:1: (root): the file is empty"


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_yaml(tmp_path / "missing.yaml", display="missing.yaml")
    assert str(info.value).startswith("missing.yaml:1:1: (file): cannot read: ")


def test_dotted_paths() -> None:
    assert dotted(("stages", 2, "thinking", "end")) == "stages[2].thinking.end"
    assert dotted(("models", 0)) == "models[0]"
    assert dotted(()) == "(root)"
    assert str(Problem("f.yaml", 12, 5, "stages[2].thinking.end", "Field required")) == (
        "f.yaml:12:5: stages[2].thinking.end: Field required"
    )
