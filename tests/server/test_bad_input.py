"""Bad input gets a clear 4xx in the protocol's own error shape; the server keeps serving."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.server

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"
OK_CHAT = {"model": "replay-qwen3", "messages": [{"role": "user", "content": "hi"}]}
OK_MSG = {
    "model": "replay-qwen3",
    "max_tokens": 16,
    "messages": [{"role": "user", "content": "hi"}],
}
OK_RESP = {"model": "replay-qwen3", "input": "hi"}

# (route, raw body or JSON, expected status, expected param or None)
CASES: list[tuple[str, Any, int, str | None]] = [
    (CHAT, b"{not json", 400, None),
    (CHAT, b"[1, 2]", 400, None),
    (CHAT, {"model": "replay-qwen3"}, 400, "messages"),
    (CHAT, {**OK_CHAT, "temperature": "hot"}, 400, "temperature"),
    (CHAT, {**OK_CHAT, "temperature": 7}, 400, "temperature"),
    (CHAT, {**OK_CHAT, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {**OK_CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    (CHAT, {**OK_CHAT, "model": "no-such-model"}, 404, "model"),
    (
        CHAT,
        {**OK_CHAT, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
        400,
        "tool_choice",
    ),
    (MESSAGES, b"{not json", 400, None),
    (
        MESSAGES,
        {"model": "replay-qwen3", "messages": [{"role": "user", "content": "hi"}]},
        400,
        "max_tokens",
    ),
    (MESSAGES, {**OK_MSG, "messages": "hi"}, 400, "messages"),
    (MESSAGES, {**OK_MSG, "temperature": 3}, 400, "temperature"),
    (MESSAGES, {**OK_MSG, "model": "no-such-model"}, 404, "model"),
    (
        MESSAGES,
        {
            **OK_MSG,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
                        }
                    ],
                }
            ],
        },
        400,
        None,
    ),
    (RESPONSES, b"{not json", 400, None),
    (RESPONSES, {"model": "replay-qwen3"}, 400, "input"),
    (RESPONSES, {**OK_RESP, "max_output_tokens": -1}, 400, "max_output_tokens"),
    (RESPONSES, {**OK_RESP, "model": "no-such-model"}, 404, "model"),
]


def post(base: str, route: str, body: Any) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(
            f"{base}{route}", content=body, headers={"content-type": "application/json"}, timeout=30
        )
    return httpx.post(f"{base}{route}", json=body, timeout=30)


@pytest.mark.parametrize(("route", "body", "status", "param"), CASES)
def test_bad_input_table(
    replay_server: str, route: str, body: Any, status: int, param: str | None
) -> None:
    response = post(replay_server, route, body)
    assert response.status_code == status, response.text
    payload = response.json()
    if route == MESSAGES:
        assert payload["type"] == "error"
        assert set(payload["error"]) >= {"type", "message"}
        assert payload["error"]["type"] == (
            "not_found_error" if status == 404 else "invalid_request_error"
        )
    else:
        error = payload["error"]
        assert set(error) >= {"message", "type", "param", "code"}
        assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
        if param is not None:
            assert error["param"] is not None and param in error["param"]
    assert (
        post(
            replay_server, CHAT, {**OK_CHAT, "mock_response": "<think>\n</think>\n\nstill here"}
        ).status_code
        == 200
    )


def test_body_too_large(replay_server: str) -> None:
    huge = {**OK_CHAT, "messages": [{"role": "user", "content": "x" * (17 * 1024 * 1024)}]}
    response = post(replay_server, CHAT, huge)
    assert response.status_code == 413
    assert response.json()["error"]["message"]


def test_unknown_route_and_method(replay_server: str) -> None:
    missing = httpx.get(f"{replay_server}/v1/nothing", timeout=10)
    assert missing.status_code == 404 and "error" in missing.json()
    wrong = httpx.get(f"{replay_server}{CHAT}", timeout=10)
    assert wrong.status_code == 405 and "error" in wrong.json()


def test_query_string_and_head_root(replay_server: str) -> None:
    assert httpx.head(f"{replay_server}/", timeout=10).status_code == 200
    response = httpx.post(
        f"{replay_server}{MESSAGES}?beta=true",
        json={**OK_MSG, "mock_response": "<think>\n</think>\n\nok"},
        timeout=30,
    )
    assert response.status_code == 200 and response.json()["content"][0]["text"] == "ok"
