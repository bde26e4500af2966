"""Keep-alives while nothing is generated, routes as data, API keys: a real server
from a config written by the test."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from anthropic import Anthropic

from tests.server.serverproc import REPO, running_server

pytestmark = pytest.mark.server

CONFIG = f"""
server: {{keepalive_interval: 0.2, body_read_timeout: 1}}
pipelines_dir: {REPO / "pipelines"}
models:
  - name: slow
    source: demo:qwen3
    pipeline: qwen3
    engine: replay
    aliases: ["claude-*"]
    replay: {{completion: "<think>\\n</think>\\n\\nslow answer", delay: 0.5}}
endpoints:
  - {{route: /v1/chat/completions, api: openai-chat}}
  - {{route: /anthropic/v1/messages, api: anthropic-messages}}
"""


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("cfg") / "slow.yaml"
    path.write_text(CONFIG)
    with running_server(path, env={"PIPESERVE_API_KEY": "sekrit"}) as base:
        yield base


def raw_stream(url: str, body: dict, headers: dict[str, str]) -> str:
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        return "".join(resp.iter_text())


def test_openai_stream_sends_keepalive_comments(slow_server: str) -> None:
    body = {"model": "slow", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    text = raw_stream(
        f"{slow_server}/v1/chat/completions", body, {"Authorization": "Bearer sekrit"}
    )
    assert ": keep-alive" in text
    assert text.rstrip().endswith("data: [DONE]")


def test_anthropic_stream_pings_on_a_yaml_route_and_alias(slow_server: str) -> None:
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
    }
    text = raw_stream(f"{slow_server}/anthropic/v1/messages", body, {"x-api-key": "sekrit"})
    assert "event: ping" in text and "event: message_stop" in text
    client = Anthropic(base_url=f"{slow_server}/anthropic", api_key="sekrit", max_retries=0)
    message = client.messages.create(
        model="claude-haiku-4-5", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
    )
    assert message.content[0].text == "slow answer"
    assert message.model == "claude-haiku-4-5"


def test_api_key_is_enforced_in_protocol_shape(slow_server: str) -> None:
    denied = httpx.post(
        f"{slow_server}/v1/chat/completions", json={"model": "slow", "messages": []}, timeout=10
    )
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
    denied = httpx.post(
        f"{slow_server}/anthropic/v1/messages", json={}, headers={"x-api-key": "wrong"}, timeout=10
    )
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"


def test_body_shorter_than_content_length_gets_408(slow_server: str) -> None:
    import json
    import socket

    host, port = slow_server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekrit\r\n"
            b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"model"'
        )
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    assert "no request body bytes arrived for 1 s" in json.loads(body)["error"]["message"]
