"""A non-streaming request that runs past server.request_timeout gets the protocol's own
504 error body (the server keeps serving): a real server from a config written here."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.server.serverproc import REPO, running_server

pytestmark = pytest.mark.server

CONFIG = f"""
server: {{request_timeout: 0.5}}
pipelines_dir: {REPO / "pipelines"}
models:
  - name: slow
    source: demo:qwen3
    pipeline: qwen3
    engine: replay
    replay: {{completion: "one two three four five six seven eight nine ten", delay: 0.2}}
endpoints:
  - {{route: /v1/chat/completions, api: openai-chat}}
  - {{route: /v1/messages, api: anthropic-messages}}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("cfg") / "timeout.yaml"
    path.write_text(CONFIG)
    with running_server(path) as base:
        yield base


def test_chat_json_past_the_deadline_is_a_504_in_chat_shape(server: str) -> None:
    body = {"model": "slow", "messages": [{"role": "user", "content": "hi"}]}
    resp = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 504
    assert "request_timeout" in resp.json()["error"]["message"]
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200


def test_anthropic_json_past_the_deadline_is_a_504_in_anthropic_shape(server: str) -> None:
    body = {"model": "slow", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
    resp = httpx.post(f"{server}/v1/messages", json=body, timeout=30)
    assert resp.status_code == 504
    assert resp.json()["type"] == "error" and resp.json()["error"]["type"] == "timeout_error"
