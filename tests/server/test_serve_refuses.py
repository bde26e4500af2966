"""`pipeserve serve` refuses to start, with a clear message, when a model is missing."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.server.serverproc import REPO, free_port, pipeserve_command


def test_missing_model_folder_refuses_to_start(tmp_path: Path) -> None:
    config = tmp_path / "missing.yaml"
    config.write_text(
        f"pipelines_dir: {REPO / 'pipelines'}\n"
        "models:\n  - {name: x, source: /nonexistent/model, pipeline: qwen3}\n"
        "endpoints:\n  - {route: /v1/chat/completions, api: openai-chat}\n"
    )
    result = subprocess.run(
        [*pipeserve_command(), "serve", "--config", str(config), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 1
    assert "model 'x': cannot get '/nonexistent/model'" in result.stderr
