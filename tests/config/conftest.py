"""Test-only stage kinds (prefixed test_) so config tests do not depend on the real stages.

They are registered for each test and removed afterwards, so they never leak into other
test packages that enumerate the registry.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest

from pipeserve.stages.base import STAGE_REGISTRY, BuildEnv, StageParams, StreamStage, register_stage


class RenderParams(StageParams):
    think_start: str = "<think>"


class NoParams(StageParams):
    pass


class ThinkingParams(StageParams):
    start: str
    end: str


class ToolCallParams(StageParams):
    format: Literal["json", "glm", "kimi", "harmony"]
    start: str = "<tool_call>"
    end: str = "</tool_call>"
    max_calls: int = 8


TEST_KINDS: dict[str, tuple[type[StageParams], Any]] = {
    "test_render": (RenderParams, "render"),
    "test_generate": (NoParams, "generate"),
    "test_thinking": (ThinkingParams, "transform"),
    "test_tool_calls": (ToolCallParams, "transform"),
    "test_stop": (NoParams, "transform"),
}


def _factory(params: StageParams, env: BuildEnv) -> StreamStage:
    return StreamStage()


@pytest.fixture(autouse=True)
def test_stage_kinds() -> Iterator[dict[str, Any]]:
    added = []
    for kind, (params, role) in TEST_KINDS.items():
        if kind not in STAGE_REGISTRY:
            register_stage(kind, params, role=role, description=f"test stage {kind}")(_factory)
            added.append(kind)
    yield dict(STAGE_REGISTRY)
    for kind in added:
        STAGE_REGISTRY.pop(kind, None)


GOOD_PIPELINE = """\
family: qwen3
stages:
  - test_render: {}
  - test_generate: {}
  - test_thinking: {start: "<think>", end: "</think>"}
  - test_tool_calls: {format: json}
  - test_stop:
"""

GOOD_CONFIG = """\
server: {host: 127.0.0.1, port: 8080}
models:
  - name: demo
    source: demo:qwen3
    pipeline: qwen3
endpoints:
  - {route: /v1/chat/completions, api: openai-chat}
  - {route: /v1/messages, api: anthropic-messages}
"""


class Tree:
    """A tmp folder with configs/ and pipelines/; write() returns the file's path."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def write(self, relative: str, text: str) -> Path:
        path = self.root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
        return path


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Tree:
    """Working directory = tmp_path, so messages name files as configs/x.yaml."""
    monkeypatch.chdir(tmp_path)
    return Tree(tmp_path)
