"""`pipeserve serve` on a machine that has never built the demo model (the README's
first command): the model is built before the workers fork, and they still generate."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.server.serverproc import REPO, running_server

pytestmark = pytest.mark.server

CONFIG = f"""
pipelines_dir: {REPO / "pipelines"}
models:
  - {{name: demo, source: "demo:qwen3", pipeline: qwen3}}
endpoints:
  - {{route: /v1/chat/completions, api: openai-chat}}
"""


def test_first_start_builds_the_demo_model_and_serves(tmp_path: Path) -> None:
    config = tmp_path / "fresh.yaml"
    config.write_text(CONFIG)
    home = tmp_path / "home"
    with running_server(config, env={"PIPESERVE_HOME": str(home)}) as base:
        assert (home / "demo").is_dir()
        body = {
            "model": "demo",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "temperature": 0,
        }
        # A worker forked from a master that had run MLX hung here forever.
        reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
