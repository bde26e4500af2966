"""OpenAI Responses against the published reference: the response object echoes the
request, every Finish cause ends with the right status, and each request field is
honoured, ignored or refused by name.

The official openai SDK builds the requests and parses (and accumulates) the answers.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from pipeserve.api.base import RequestMeta
from pipeserve.api.openai_responses.protocol import OpenAIResponses
from pipeserve.errors import ApiError
from pipeserve.events import (
    ContentDelta,
    ErrorEvent,
    Event,
    Finish,
    PromptReady,
    ReasoningDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from pipeserve.request import GenerationRequest
from tests.api.helpers import (
    QWEN3_CALL,
    Harness,
    ctx_for,
    data_frames,
    final_via_sdk,
    replay_events,
)

PROTOCOL = OpenAIResponses()
META = RequestMeta(route="/v1/responses")
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
TEXT: list[Event] = [
    PromptReady(9, 2),
    ReasoningDelta("Hm."),
    ContentDelta("Hello"),
    Finish("stop"),
    Usage(9, 4, 2, 1),
]


def fn(name: str) -> dict[str, Any]:
    return {"type": "function", "name": name, "parameters": {"type": "object", "properties": {}}}


def decode(**body: Any) -> GenerationRequest:
    return PROTOCOL.decode({"model": "demo", "input": "hi", **body}, META)


def encode_json(events: list[Event], **body: Any) -> dict[str, Any]:
    return PROTOCOL.encode_json(iter(events), ctx_for(decode(**body)))


def stream(events: list[Event], **body: Any) -> bytes:
    return b"".join(PROTOCOL.encode_stream(iter(events), ctx_for(decode(stream=True, **body))))


# ---------------------------------------------------------------- response fields

ECHOED: dict[str, Any] = {
    "instructions": "Be brief.",
    "tools": [fn("get_weather")],
    "tool_choice": "required",
    "parallel_tool_calls": False,
    "temperature": 0.3,
    "top_p": 0.9,
    "top_logprobs": 2,
    "max_output_tokens": 100,
    "max_tool_calls": 3,
    "truncation": "auto",
    "metadata": {"k": "v"},
    "user": "u-1",
    "safety_identifier": "sid",
    "prompt_cache_key": "pck",
    "prompt_cache_retention": "24h",
    "reasoning": {"effort": "low", "summary": "auto"},
    "text": {"format": {"type": "text"}, "verbosity": "low"},
}


def test_response_echoes_the_request_parameters() -> None:
    body = encode_json(TEXT, **ECHOED)
    Response.model_validate(body)
    for key, value in ECHOED.items():
        assert body[key] == value, key
    assert (
        body["store"] is False and body["background"] is False
    )  # nothing is stored or backgrounded
    for key in ("previous_response_id", "conversation", "prompt", "error", "incomplete_details"):
        assert key in body and body[key] is None, key
    assert body["service_tier"] == "default"
    assert isinstance(body["created_at"], int) and isinstance(body["completed_at"], int)


def test_defaults_are_spelled_out() -> None:
    body = encode_json(TEXT)
    assert body["text"] == {"format": {"type": "text"}, "verbosity": "medium"}
    assert body["reasoning"] == {"effort": None, "summary": None}
    assert (body["truncation"], body["tool_choice"], body["tools"], body["metadata"]) == (
        "disabled",
        "auto",
        [],
        {},
    )
    assert body["max_tool_calls"] is None and body["user"] is None


def test_usage_details_and_item_fields() -> None:
    body = encode_json(TEXT)
    assert body["usage"] == {
        "input_tokens": 9,
        "input_tokens_details": {"cached_tokens": 2, "cache_write_tokens": 0},
        "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 1},
        "total_tokens": 13,
    }
    reasoning, message = body["output"]
    assert reasoning["id"].startswith("rs_") and reasoning["summary"] == []
    assert message["id"].startswith("msg_") and message["status"] == "completed"
    assert message["content"] == [
        {"type": "output_text", "text": "Hello", "annotations": [], "logprobs": []}
    ]


def test_stream_snapshots_are_valid_and_only_completion_has_completed_at() -> None:
    events = data_frames(stream(TEXT, **ECHOED))
    for event in events:
        EVENTS.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    created, in_progress, completed = events[0], events[1], events[-1]
    assert created["type"] == "response.created" and in_progress["type"] == "response.in_progress"
    assert created["response"]["completed_at"] is None and created["response"]["usage"] is None
    assert (
        completed["type"] == "response.completed"
        and completed["response"]["completed_at"] is not None
    )
    assert completed["response"]["max_tool_calls"] == 3 and completed["response"]["user"] == "u-1"


CALL: list[Event] = [
    ToolCallStart(0, "call_1", "get_weather"),
    ToolCallEnd(0, '{"city": "Oslo"}'),
    Finish("tool_calls"),
]


@pytest.mark.parametrize(
    ("events", "status", "details", "last_item_status"),
    [
        ([ContentDelta("x"), Finish("stop")], "completed", None, "completed"),
        (
            [ContentDelta("x"), Finish("length")],
            "incomplete",
            {"reason": "max_output_tokens"},
            "incomplete",
        ),
        (CALL, "completed", None, "completed"),
    ],
)
def test_status_for_each_finish_cause(
    events: list[Event], status: str, details: Any, last_item_status: str
) -> None:
    run = [PromptReady(3), *events, Usage(3, 2)]
    body = encode_json(run, tools=[fn("get_weather")])
    assert (body["status"], body["incomplete_details"]) == (status, details)
    assert body["output"][-1]["status"] == last_item_status
    last = data_frames(stream(run, tools=[fn("get_weather")]))[-1]
    assert last["type"] == f"response.{status}"
    assert (
        last["response"]["status"] == status
        and last["response"]["output"][-1]["status"] == last_item_status
    )
    if status == "completed":  # the SDK accumulator only finishes on response.completed
        final = final_via_sdk(stream(run, tools=[fn("get_weather")]))
        assert final.output[-1].status == last_item_status


@pytest.mark.parametrize(
    "events",
    [[ErrorEvent("internal", "boom"), Finish("error")], [Finish("cancelled")]],
    ids=["error", "cancelled"],
)
def test_error_and_cancel_end_with_response_failed(events: list[Event]) -> None:
    run = [PromptReady(3), ContentDelta("x"), *events, Usage(3, 1)]
    frames = data_frames(stream(run))
    last = frames[-1]
    assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
    assert last["response"]["error"]["code"] == "server_error"
    assert all(f["type"] != "response.completed" for f in frames)
    with pytest.raises(ApiError):
        encode_json(run)


# ---------------------------------------------------------------- request fields


def sdk() -> tuple[Harness, Any]:
    harness = Harness(
        PROTOCOL, lambda ctx: [PromptReady(3), ContentDelta("ok"), Finish("stop"), Usage(3, 1)]
    )
    return harness, harness.client.responses


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    (
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": "object"}}},
        "text.format.schema",
    ),
    ({"prompt": {"id": "pmpt_1", "version": "2"}}, "prompt"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"truncation": "sometimes"}, "truncation"),
    (
        {"input": [{"type": "item_reference", "id": "msg_1"}, {"role": "user", "content": "q"}]},
        "input[0]",
    ),
    ({"reasoning": {"summary": "verbose"}}, "reasoning.summary"),
    (
        {
            "tools": [fn("a")],
            "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": []},
        },
        "tool_choice",
    ),
]


@pytest.mark.parametrize(("fields", "param"), REFUSED)
def test_unhonoured_or_malformed_parameters_are_a_400_naming_them(
    fields: dict[str, Any], param: str
) -> None:
    harness, responses = sdk()
    with pytest.raises(openai.BadRequestError) as info:
        responses.create(model="demo", input="hi", extra_body=fields)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param  # type: ignore[index]
    assert param in info.value.message
    assert harness.requests == []


def test_harmless_parameters_are_accepted() -> None:
    harness, responses = sdk()
    result = responses.create(
        model="demo",
        input="hi",
        store=True,
        # A value from a newer client asks for more output; it is not a reason to refuse.
        include=[
            "reasoning.encrypted_content",
            "message.output_text.logprobs",
            "some.future.value",
        ],
        stream_options=None,
        service_tier="auto",
        prompt_cache_key="k",
        safety_identifier="s",
        max_tool_calls=2,
        truncation="auto",
        text={"format": {"type": "text"}, "verbosity": "high"},
        reasoning={"effort": "medium", "summary": "detailed"},
        user="u",
        metadata={"a": "b"},
    )
    assert result.output_text == "ok"
    assert result.reasoning is not None and result.reasoning.summary == "detailed"
    assert result.truncation == "auto" and result.max_tool_calls == 2
    assert harness.requests[0].logprobs is True


def test_allowed_tools_restricts_the_tool_list() -> None:
    choice = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": "b"}],
    }
    req = decode(tools=[fn("a"), fn("b")], tool_choice=choice)
    assert [t.name for t in req.tools] == ["b"] and req.tool_choice.mode == "required"
    auto = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "a"}]}
    req = decode(tools=[fn("a"), fn("b")], tool_choice=auto)
    assert [t.name for t in req.tools] == ["a"] and req.tool_choice.mode == "auto"
    assert encode_json(TEXT, tools=[fn("a"), fn("b")], tool_choice=auto)["tool_choice"] == auto


# ---------------------------------------------------------------- real pipeline (replay engine)


def test_replay_pipeline_events_validate_and_echo(qwen3_runtime: Any) -> None:
    body = {
        "model": "replay-qwen3",
        "input": "Weather in Paris?",
        "tools": [fn("get_weather")],
        "reasoning": {"effort": "low", "summary": "auto"},
        "include": ["reasoning.encrypted_content"],
        "max_tool_calls": 1,
        "mock_response": QWEN3_CALL,
    }
    plain = Response.model_validate(
        PROTOCOL.encode_json(*replay_events(qwen3_runtime, PROTOCOL, body, META.route))
    )
    raw = b"".join(
        PROTOCOL.encode_stream(
            *replay_events(qwen3_runtime, PROTOCOL, {**body, "stream": True}, META.route)
        )
    )
    events = data_frames(raw)
    for event in events:
        EVENTS.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    streamed = final_via_sdk(raw)
    for result in (plain, streamed):
        assert [item.type for item in result.output] == ["reasoning", "message", "function_call"]
        reasoning, message, call = result.output
        assert reasoning.encrypted_content and message.content[0].text == "Sure."  # type: ignore[union-attr]
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")  # type: ignore[union-attr]
        assert call.arguments == '{"city": "Paris"}' and call.status == "completed"  # type: ignore[union-attr]
        assert (
            result.reasoning and result.reasoning.summary == "auto" and result.max_tool_calls == 1
        )
        assert result.usage and result.usage.output_tokens_details.reasoning_tokens > 0
