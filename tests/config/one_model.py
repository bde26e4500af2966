"""A config with one demo model whose options a test sets, and `pipeserve validate` on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeserve.cli import main

REPO = Path(__file__).resolve().parents[2]


def one_model_config(path: Path, options: str, *, extra_model: str = "", server: str = "") -> Path:
    """Model `x` (demo qwen3), one Chat route; `options` is the YAML after `options:`
    (a flow mapping on the line, or indented block lines), kept byte for byte so that
    error positions stay where the tests expect them."""
    path.write_text(
        f"pipelines_dir: {REPO / 'pipelines'}\n"
        f"{server}"
        "models:\n"
        "  - name: x\n"
        "    source: demo:qwen3\n"
        "    pipeline: qwen3\n"
        f"    options:{options}\n"
        f"{extra_model}"
        "endpoints:\n  - {route: /v1/chat/completions, api: openai-chat}\n"
    )
    return path


def validate(config: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["validate", str(config)])
    return code, capsys.readouterr().err
