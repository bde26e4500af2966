"""Hostile and unusual HTTP input against a real server: never a 500 or a dropped socket."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

pytestmark = pytest.mark.server

ROUTES = {
    "/v1/chat/completions": {
        "model": "replay-qwen3",
        "messages": [{"role": "user", "content": "hi"}],
    },
    "/v1/messages": {
        "model": "replay-qwen3",
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "hi"}],
    },
    "/v1/responses": {"model": "replay-qwen3", "input": "hi"},
}
MOCK = "<think>\n</think>\n\nok"


def error_message(route: str, response: httpx.Response) -> str:
    payload = response.json()
    if route == "/v1/messages":
        assert payload["type"] == "error"
        return str(payload["error"]["message"])
    return str(payload["error"]["message"])


@pytest.mark.parametrize("route", list(ROUTES))
def test_deeply_nested_json_is_a_400(replay_server: str, route: str) -> None:
    body = '{"model": "replay-qwen3", "x": ' + "[" * 50_000 + "]" * 50_000 + "}"
    response = httpx.post(
        f"{replay_server}{route}",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    assert "JSON" in error_message(route, response)


@pytest.mark.parametrize("route", list(ROUTES))
def test_lone_surrogate_escapes_are_served(replay_server: str, route: str) -> None:
    # A JS client that cut a string inside an emoji sends an unpaired "\ud83d" escape.
    body = json.dumps({**ROUTES[route], "mock_response": MOCK}).replace(
        '"hi"', '"hi \\ud83d there \\udfff"'
    )
    response = httpx.post(
        f"{replay_server}{route}",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 200, response.text


def chunks(data: bytes, size: int = 7) -> Iterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


@pytest.mark.parametrize("route", list(ROUTES))
def test_chunked_request_body(replay_server: str, route: str) -> None:
    data = json.dumps({**ROUTES[route], "mock_response": MOCK}).encode()
    response = httpx.post(
        f"{replay_server}{route}",
        content=chunks(data),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("route", list(ROUTES))
def test_request_id_headers_on_success_and_error(replay_server: str, route: str) -> None:
    ok = httpx.post(
        f"{replay_server}{route}", json={**ROUTES[route], "mock_response": MOCK}, timeout=30
    )
    bad = httpx.post(f"{replay_server}{route}", json={"model": "replay-qwen3"}, timeout=30)
    for response in (ok, bad):
        assert response.headers["request-id"].startswith("req_")  # anthropic SDK: _request_id
        assert response.headers["x-request-id"] == response.headers["request-id"]  # openai SDK
    assert ok.headers["request-id"] != bad.headers["request-id"]


def test_routing_errors_on_anthropic_routes_have_the_anthropic_shape(replay_server: str) -> None:
    wrong_method = httpx.get(f"{replay_server}/v1/messages", timeout=10)
    assert wrong_method.status_code == 405
    assert (
        wrong_method.json()["type"] == "error"
        and wrong_method.json()["error"]["type"] == "invalid_request_error"
    )
    unknown = httpx.post(
        f"{replay_server}/v1/messages/batches",
        json={},
        headers={"anthropic-version": "2023-06-01"},
        timeout=10,
    )
    assert unknown.status_code == 404
    assert unknown.json() == {
        "type": "error",
        "error": {"type": "not_found_error", "message": unknown.json()["error"]["message"]},
    }
    openai_unknown = httpx.post(f"{replay_server}/v1/embeddings", json={}, timeout=10)
    assert (
        openai_unknown.status_code == 404
        and openai_unknown.json()["error"]["type"] == "not_found_error"
    )


def test_head_on_models(replay_server: str) -> None:
    assert httpx.head(f"{replay_server}/v1/models", timeout=10).status_code == 200


def test_prompt_over_the_context_length_speaks_each_protocols_dialect(replay_server: str) -> None:
    """Agents react to these exact markers: Codex to code `context_length_exceeded`,
    Claude Code to an error message starting `prompt is too long`."""
    long_text = "word " * 60_000  # replay-qwen3's context is 40960 tokens
    chat = httpx.post(
        f"{replay_server}/v1/chat/completions",
        json={
            **ROUTES["/v1/chat/completions"],
            "messages": [{"role": "user", "content": long_text}],
        },
        timeout=60,
    )
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "context_length_exceeded"
    responses = httpx.post(
        f"{replay_server}/v1/responses",
        json={**ROUTES["/v1/responses"], "input": long_text},
        timeout=60,
    )
    assert (
        responses.status_code == 400
        and responses.json()["error"]["code"] == "context_length_exceeded"
    )
    assert responses.json()["error"]["param"] == "input"
    messages = httpx.post(
        f"{replay_server}/v1/messages",
        json={**ROUTES["/v1/messages"], "messages": [{"role": "user", "content": long_text}]},
        timeout=60,
    )
    assert messages.status_code == 400
    assert messages.json()["error"]["type"] == "invalid_request_error"
    assert messages.json()["error"]["message"].startswith("prompt is too long: ")


@pytest.mark.parametrize("seed", [-1, 2**64, -(2**70)])
def test_any_integer_seed_is_served_by_the_real_engine(demo_server: str, seed: int) -> None:
    body = {
        "model": "demo",
        "max_tokens": 2,
        "seed": seed,
        "messages": [{"role": "user", "content": "hi"}],
    }
    first = httpx.post(f"{demo_server}/v1/chat/completions", json=body, timeout=120)
    assert first.status_code == 200, first.text
    again = httpx.post(
        f"{demo_server}/v1/responses",
        json={"model": "demo", "max_output_tokens": 2, "seed": seed, "input": "hi"},
        timeout=120,
    )
    assert again.status_code == 200, again.text


def test_count_tokens_counts_a_conversation_longer_than_the_context(replay_server: str) -> None:
    """Claude Code measures its context with count_tokens; an over-full conversation
    must be counted (so it can compact), not refused."""
    body = {"model": "replay-qwen3", "messages": [{"role": "user", "content": "word " * 60_000}]}
    response = httpx.post(f"{replay_server}/v1/messages/count_tokens", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["input_tokens"] > 40960
