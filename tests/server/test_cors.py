"""CORS for browser clients: off by default; configured origins get preflight answers
and readable responses, also when an API key guards the routes (preflights carry none)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.server.serverproc import REPO, running_server

pytestmark = pytest.mark.server

ORIGIN = "http://localhost:3000"
CONFIG = f"""
server: {{cors_allow_origins: ["{ORIGIN}"]}}
pipelines_dir: {REPO / "pipelines"}
models:
  - {{name: replay, source: "demo:qwen3", pipeline: qwen3, engine: replay, replay: {{completion: "hello"}}}}
endpoints:
  - {{route: /v1/chat/completions, api: openai-chat}}
"""
BODY = {"model": "replay", "messages": [{"role": "user", "content": "hi"}]}
PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


@pytest.fixture(scope="module")
def cors_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("cors") / "cors.yaml"
    path.write_text(CONFIG)
    with running_server(path, env={"PIPESERVE_API_KEY": "k"}) as base:
        yield base


def test_preflight_from_an_allowed_origin(cors_server: str) -> None:
    reply = httpx.options(
        f"{cors_server}/v1/chat/completions", headers={"Origin": ORIGIN, **PREFLIGHT}
    )
    assert reply.status_code == 200
    assert reply.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in reply.headers["access-control-allow-methods"]
    assert "authorization" in reply.headers["access-control-allow-headers"].lower()


def test_responses_are_readable_by_the_allowed_origin_only(cors_server: str) -> None:
    auth = {"Authorization": "Bearer k"}
    allowed = httpx.post(
        f"{cors_server}/v1/chat/completions", json=BODY, headers={"Origin": ORIGIN, **auth}
    )
    assert (
        allowed.status_code == 200 and allowed.json()["choices"][0]["message"]["content"] == "hello"
    )
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in allowed.headers["access-control-expose-headers"]
    other = httpx.post(
        f"{cors_server}/v1/chat/completions",
        json=BODY,
        headers={"Origin": "http://evil.test", **auth},
    )
    assert "access-control-allow-origin" not in other.headers


def test_no_cors_headers_unless_configured(replay_server: str) -> None:
    reply = httpx.options(
        f"{replay_server}/v1/chat/completions", headers={"Origin": ORIGIN, **PREFLIGHT}
    )
    assert "access-control-allow-origin" not in reply.headers
