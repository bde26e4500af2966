"""Several API keys (YAML, scoped to models, and the environment's) and the per-request
log (JSON lines), on a real server with the real SDKs as clients."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.server.serverproc import REPO, running_server

pytestmark = pytest.mark.server

YAML_KEY = "sk-yaml-team-0001"
SCOPED_KEY = "sk-scoped-0002"
ENV_KEY = "sk-env-0003"
LEGACY_KEY = "sk-legacy-0004"
ALL_KEYS = (YAML_KEY, SCOPED_KEY, ENV_KEY, LEGACY_KEY)
CONFIG = f"""
server:
  log_format: json
  log_level: info
  api_keys:
    - {{key: {YAML_KEY}, name: team}}
    - {{key: {SCOPED_KEY}, name: intern, models: [small]}}
pipelines_dir: {REPO / "pipelines"}
models:
  - {{name: small, source: "demo:qwen3", pipeline: qwen3, engine: replay, replay: {{completion: "small answer"}}}}
  - {{name: big, source: "demo:qwen3", pipeline: qwen3, engine: replay, replay: {{completion: "big answer", delay: 0.05}}}}
endpoints:
  - {{route: /v1/chat/completions, api: openai-chat}}
  - {{route: /v1/messages, api: anthropic-messages}}
  - {{route: /v1/completions, api: openai-completions}}
  - {{route: /api, api: ollama}}
"""
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    folder = tmp_path_factory.mktemp("keys")
    path = folder / "keys.yaml"
    path.write_text(CONFIG)
    env = {"PIPESERVE_API_KEYS": f"{ENV_KEY}, other-env-key", "PIPESERVE_API_KEY": LEGACY_KEY}
    old = os.environ.get("PYTEST_SERVER_LOG_DIR")
    os.environ["PYTEST_SERVER_LOG_DIR"] = str(folder)
    try:
        with running_server(path, env=env) as base:
            yield base, next(folder.glob("pipeserve-test-*.log"))
    finally:
        if old is None:
            os.environ.pop("PYTEST_SERVER_LOG_DIR", None)
        else:
            os.environ["PYTEST_SERVER_LOG_DIR"] = old


def chat(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)


def messages(base: str, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key=key, max_retries=0)


def request_lines(log: Path, request_id: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The JSON request-log lines of one request (written when its body is done)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        found = [line for line in lines if line.get("request_id") == request_id]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


@pytest.mark.parametrize("key", ALL_KEYS)
def test_every_configured_key_is_accepted(keyed: tuple[str, Path], key: str) -> None:
    reply = chat(keyed[0], key).chat.completions.create(model="small", messages=HI)
    assert reply.choices[0].message.content == "small answer"


def test_missing_or_wrong_key_is_a_401_in_each_protocols_shape(keyed: tuple[str, Path]) -> None:
    base = keyed[0]
    with pytest.raises(openai.AuthenticationError) as openai_error:
        chat(base, "sk-wrong").chat.completions.create(model="small", messages=HI)
    assert openai_error.value.status_code == 401
    assert openai_error.value.body["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(anthropic.AuthenticationError) as anthropic_error:
        messages(base, YAML_KEY + "x").messages.create(model="small", max_tokens=8, messages=HI)
    body = anthropic_error.value.body
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"  # type: ignore[index]
    bare = httpx.post(f"{base}/v1/messages", json={"model": "small"}, timeout=10)
    assert bare.status_code == 401 and bare.json()["error"]["type"] == "authentication_error"


def test_completions_and_ollama_routes_take_keys_too(keyed: tuple[str, Path]) -> None:
    base = keyed[0]
    with pytest.raises(openai.AuthenticationError):
        chat(base, "sk-wrong").completions.create(model="small", prompt="x")
    assert chat(base, ENV_KEY).completions.create(model="small", prompt="x").choices[0].text
    with pytest.raises(ollama.ResponseError) as error:
        ollama.Client(host=base).chat(model="small", messages=HI)
    assert error.value.status_code == 401 and "API key" in error.value.error
    with pytest.raises(ollama.ResponseError) as listing:
        ollama.Client(host=base).list()
    assert listing.value.status_code == 401
    scoped = ollama.Client(host=base, headers={"Authorization": f"Bearer {SCOPED_KEY}"})
    assert scoped.chat(model="small", messages=HI).message.content == "small answer"
    assert [m.model for m in scoped.list().models] == ["small"]
    with pytest.raises(ollama.ResponseError) as hidden:
        scoped.chat(model="big", messages=HI)
    assert hidden.value.status_code == 404
    tags = httpx.get(f"{base}/api/tags", headers={"Authorization": f"Bearer {SCOPED_KEY}"})
    [line] = request_lines(keyed[1], tags.headers["x-request-id"])
    assert (line["protocol"], line["key"], line["status"]) == ("ollama", "intern", 200)


def test_a_scoped_key_sees_other_models_as_not_found(keyed: tuple[str, Path]) -> None:
    base = keyed[0]
    ok = messages(base, SCOPED_KEY).messages.create(model="small", max_tokens=8, messages=HI)
    assert ok.content[0].text == "small answer"  # type: ignore[union-attr]
    with pytest.raises(openai.NotFoundError) as openai_error:
        chat(base, SCOPED_KEY).chat.completions.create(model="big", messages=HI)
    assert openai_error.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert "big" not in openai_error.value.body["message"].split("serves:")[1]  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError):
        messages(base, SCOPED_KEY).messages.create(model="big", max_tokens=8, messages=HI)
    listed = chat(base, SCOPED_KEY).models.list()
    assert [m.id for m in listed.data] == ["small"]
    assert [m.id for m in chat(base, YAML_KEY).models.list().data] == ["small", "big"]


def test_health_is_open_metrics_and_cluster_need_an_unrestricted_key(
    keyed: tuple[str, Path],
) -> None:
    base = keyed[0]
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    denied = httpx.get(f"{base}/metrics", timeout=10)
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
    scoped = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {SCOPED_KEY}"})
    assert scoped.status_code == 403
    metrics = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {ENV_KEY}"})
    assert metrics.status_code == 200 and "pipeserve_requests" in metrics.text
    # /v1/cluster names every sharded model and machine: the same rule.
    assert httpx.get(f"{base}/v1/cluster", timeout=10).status_code == 401
    scoped = httpx.get(f"{base}/v1/cluster", headers={"Authorization": f"Bearer {SCOPED_KEY}"})
    assert scoped.status_code == 403 and "/v1/cluster needs an unrestricted key" in scoped.text
    cluster = httpx.get(f"{base}/v1/cluster", headers={"Authorization": f"Bearer {ENV_KEY}"})
    assert cluster.status_code == 200 and cluster.json()["models"] == {}


def test_one_json_line_per_request_with_its_facts(keyed: tuple[str, Path]) -> None:
    base, log = keyed
    raw = chat(base, YAML_KEY).chat.completions.with_raw_response.create(
        model="big", messages=HI, stream=True, stream_options={"include_usage": True}
    )
    request_id = raw.headers["x-request-id"]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in raw.parse() if chunk.choices)
    assert text == "big answer"
    [line] = request_lines(log, request_id)
    assert line["path"] == "/v1/chat/completions" and line["protocol"] == "openai-chat"
    assert line["model"] == "big" and line["status"] == 200 and line["stream"] is True
    assert line["key"] == "team" and line["finish_reason"] == "stop"
    assert line["prompt_tokens"] > 0 and line["completion_tokens"] > 0
    assert line["cached_tokens"] == 0 and line["client_disconnected"] is False
    assert 0 < line["ttft_ms"] <= line["duration_ms"]
    assert line["logger"] == "pipeserve.request" and line["level"] == "INFO"


def test_errors_and_disconnects_are_logged(keyed: tuple[str, Path]) -> None:
    base, log = keyed
    denied = httpx.post(f"{base}/v1/chat/completions", json={}, timeout=10)
    [line] = request_lines(log, denied.headers["x-request-id"])
    assert line["status"] == 401 and line["error"] == "authentication" and line["key"] is None
    body = {"model": "big", "messages": HI, "stream": True, "mock_response": "word " * 200}
    headers = {"Authorization": f"Bearer {ENV_KEY}"}
    with httpx.stream(
        "POST", f"{base}/v1/chat/completions", json=body, headers=headers, timeout=30
    ) as resp:
        request_id = resp.headers["x-request-id"]
        next(resp.iter_lines())  # one event, then hang up
    [line] = request_lines(log, request_id)
    assert line["client_disconnected"] is True and line["key"] == "env-key"
    assert line["finish_reason"] in (None, "cancelled")


def test_keys_never_reach_the_log(keyed: tuple[str, Path]) -> None:
    base, log = keyed
    httpx.post(f"{base}/v1/chat/completions", json={}, headers={"x-api-key": "sk-guess-123"})
    chat(base, SCOPED_KEY).chat.completions.create(model="small", messages=HI)
    time.sleep(0.5)
    text = log.read_text()
    assert all(key not in text for key in (*ALL_KEYS, "sk-guess-123", "other-env-key"))
