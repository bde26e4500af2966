"""Shared OpenAI helpers (api/openai_common.py): error shapes, param paths, reasoning
effort, the logprob cursor, content-part checks. The in-process SDK harness the protocol
tests use lives in tests/api/helpers.py."""

from __future__ import annotations

from typing import Any

import pytest

from pipeserve.api.base import RequestMeta, WireProtocol
from pipeserve.api.openai_chat.protocol import OpenAIChat
from pipeserve.api.openai_common import (
    LogprobCursor,
    openai_error_body,
    param_path,
    reasoning_options,
)
from pipeserve.api.openai_responses.protocol import OpenAIResponses
from pipeserve.errors import ApiError
from pipeserve.events import TokenText, TopLogprob
from pipeserve.request import GenerationRequest, Message
from tests.api.helpers import ctx_for


@pytest.mark.parametrize(
    ("kind", "param", "status", "type_", "code"),
    [
        ("invalid_request", "temperature", 400, "invalid_request_error", None),
        ("authentication", None, 401, "authentication_error", "invalid_api_key"),
        ("not_found", "model", 404, "not_found_error", "model_not_found"),
        ("not_found", None, 404, "not_found_error", "not_found"),
        ("too_large", None, 413, "invalid_request_error", "request_too_large"),
        ("overloaded", None, 429, "rate_limit_error", "rate_limit_exceeded"),
        ("rate_limit", None, 429, "rate_limit_error", "rate_limit_exceeded"),
        ("internal", None, 500, "server_error", "server_error"),
        ("unavailable", None, 503, "server_error", "service_unavailable"),
    ],
)
def test_error_shape_and_status(kind: Any, param: Any, status: int, type_: str, code: Any) -> None:
    err = ApiError(kind, "boom", param)
    expected = {"error": {"message": "boom", "type": type_, "param": param, "code": code}}
    for protocol in (OpenAIChat(), OpenAIResponses()):
        assert protocol.error_body(err) == expected == openai_error_body(err)
        assert protocol.error_status(err) == status


def test_param_path_uses_openai_notation() -> None:
    assert param_path(("messages", 0, "content", 2, "text")) == "messages[0].content[2].text"
    assert param_path(("role",), "input[3]") == "input[3].role"


@pytest.mark.parametrize(
    ("effort", "enabled", "mapped"),
    [
        (None, None, None),
        ("none", False, None),
        ("minimal", None, "minimal"),
        ("low", None, "low"),
        ("medium", None, "medium"),
        ("high", None, "high"),
        ("xhigh", None, "high"),
    ],
)
def test_reasoning_effort_mapping(effort: Any, enabled: Any, mapped: Any) -> None:
    options = reasoning_options(effort, "reasoning_effort")
    assert (options.enabled, options.effort) == (enabled, mapped)


def test_reasoning_effort_unknown_is_400() -> None:
    with pytest.raises(ApiError) as info:
        reasoning_options("extreme", "reasoning.effort")
    assert (info.value.kind, info.value.param) == ("invalid_request", "reasoning.effort")


def test_logprob_cursor_hands_out_records_once() -> None:
    req = GenerationRequest(
        model="m", messages=[Message("user", "x")], logprobs=True, top_logprobs=1
    )
    ctx = ctx_for(req)
    tops = (TopLogprob("a", -0.1, 1), TopLogprob("b", -2.0, 2))
    records = ctx.logprob_records
    cursor = LogprobCursor(ctx)
    records += [TokenText("a", 1, -0.1, tops), TokenText("é", 3, -0.5)]
    first = cursor.take()
    assert [e["token"] for e in first] == ["a", "é"]
    assert first[0]["top_logprobs"] == [{"token": "a", "logprob": -0.1, "bytes": [97]}]
    assert first[1]["bytes"] == [195, 169]
    assert cursor.take() == []
    records.append(TokenText("<think>", 9, -0.2))
    cursor.skip()
    records.append(TokenText("z", 4, None))  # no logprob recorded: no entry
    assert cursor.take() == []


@pytest.mark.parametrize("part_type", [[], {}, ["text"], None, 5])
@pytest.mark.parametrize("protocol", [OpenAIChat(), OpenAIResponses()], ids=lambda p: p.name)
def test_content_part_type_of_any_json_type_is_a_400(
    protocol: WireProtocol, part_type: Any
) -> None:
    parts = [{"type": part_type, "text": "hi"}]
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": parts}],
        "input": [{"role": "user", "content": parts}],
    }
    with pytest.raises(ApiError) as exc:
        protocol.decode(body, RequestMeta(route="/"))
    assert exc.value.kind == "invalid_request" and exc.value.param is not None
    assert exc.value.param.endswith("content[0].type")
