"""Anthropic Messages against the published reference: usage fields, the stop reason of
every Finish cause, and each request field honoured, ignored or refused by name.

The official anthropic SDK builds the requests and accumulates our streams.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest
from anthropic.types import Message as SdkMessage

from pipeserve.api.anthropic_messages.protocol import AnthropicMessages
from pipeserve.api.base import RequestMeta
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
    InProcess,
    anthropic_client,
    anthropic_events,
    anthropic_message,
    ctx_for,
    replay_events,
)

PROTOCOL = AnthropicMessages()
META = RequestMeta(route="/v1/messages")
HELLO = [{"role": "user", "content": "hi"}]
WEATHER = {
    "name": "get_weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
THINK: list[Event] = [
    PromptReady(9, 3),
    ReasoningDelta("Let me think."),
    ContentDelta("Hi!"),
    Finish("stop"),
    Usage(9, 6, 3, 4),
]


def decode(**body: Any) -> GenerationRequest:
    return PROTOCOL.decode({"model": "demo", "max_tokens": 64, "messages": HELLO, **body}, META)


def frames(events: list[Event], **body: Any) -> list[tuple[str | None, dict[str, Any]]]:
    ctx = ctx_for(decode(stream=True, **body), request_id="req_a")
    raw = b"".join(PROTOCOL.encode_stream(iter(events), ctx))
    return anthropic_events(raw)


def message_json(events: list[Event], **body: Any) -> dict[str, Any]:
    ctx = ctx_for(decode(**body), request_id="req_a")
    return PROTOCOL.encode_json(iter(events), ctx)


# ---------------------------------------------------------------- response fields


def test_usage_carries_cache_creation_and_service_tier() -> None:
    start = frames(THINK)[0][1]
    assert start["type"] == "message_start"
    usage = start["message"]["usage"]
    assert usage["cache_creation"] == {
        "ephemeral_5m_input_tokens": 0,
        "ephemeral_1h_input_tokens": 0,
    }
    assert usage["service_tier"] == "standard"
    assert (
        usage["input_tokens"],
        usage["cache_read_input_tokens"],
        usage["cache_creation_input_tokens"],
    ) == (6, 3, 0)
    body = message_json(THINK)
    anthropic.types.Message.model_validate(body)
    # message_delta's usage merges into message_start's (as the SDK does), nothing is lost
    assert body["usage"] == {
        "input_tokens": 6,
        "output_tokens": 6,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 3,
        "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
        "service_tier": "standard",
        "output_tokens_details": {"thinking_tokens": 4},
    }


def test_sdk_stream_and_create_agree_on_usage() -> None:
    sdk = anthropic_client(InProcess(PROTOCOL, THINK))
    created = sdk.messages.create(model="demo", max_tokens=64, messages=HELLO)  # type: ignore[arg-type]
    with sdk.messages.stream(model="demo", max_tokens=64, messages=HELLO) as stream:  # type: ignore[arg-type]
        final = stream.get_final_message()
    assert final.usage == created.usage
    assert created.usage.service_tier == "standard" and created.usage.cache_creation is not None


CALL: list[Event] = [
    ToolCallStart(0, "call_1", "get_weather"),
    ToolCallEnd(0, '{"city": "Oslo"}'),
    Finish("tool_calls"),
]


@pytest.mark.parametrize(
    ("events", "reason", "sequence"),
    [
        ([Finish("stop")], "end_turn", None),
        ([Finish("length")], "max_tokens", None),
        ([Finish("stop", stop_sequence="END")], "stop_sequence", "END"),
        (CALL, "tool_use", None),
    ],
)
def test_stop_reason_for_each_cause(events: list[Event], reason: str, sequence: str | None) -> None:
    run = [PromptReady(3), ContentDelta("x"), *events, Usage(3, 2)]
    body = message_json(run, tools=[WEATHER])
    assert (body["stop_reason"], body["stop_sequence"]) == (reason, sequence)
    stream = frames(run, tools=[WEATHER])
    delta = next(data for name, data in stream if name == "message_delta")
    assert delta["delta"] == {"stop_reason": reason, "stop_sequence": sequence}
    assert stream[-1][0] == "message_stop"


def test_engine_error_is_an_error_event_and_no_message_stop() -> None:
    run = [
        PromptReady(3),
        ContentDelta("x"),
        ErrorEvent("internal", "boom"),
        Finish("error"),
        Usage(3, 1),
    ]
    stream = frames(run)
    assert stream[-1] == (
        "error",
        {"type": "error", "error": {"type": "api_error", "message": "boom"}},
    )
    assert all(name != "message_stop" for name, _ in stream)
    with pytest.raises(ApiError):
        message_json(run)


# ---------------------------------------------------------------- request fields


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"output_config": {"format": {"type": "json_schema", "schema": "object"}}},
            "output_config.format.schema",
        ),
        ({"output_format": {"type": "xml", "schema": {"type": "object"}}}, "output_format.type"),
        ({"output_config": "high"}, "output_config"),
        ({"thinking": {"type": "adaptive", "display": "verbose"}}, "thinking.display"),
    ],
)
def test_unhonoured_or_malformed_fields_are_a_400_naming_them(
    fields: dict[str, Any], param: str
) -> None:
    handler = InProcess(PROTOCOL, THINK)
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_client(handler).messages.create(
            model="demo", max_tokens=64, messages=HELLO, extra_body=fields
        )  # type: ignore[arg-type]
    error = info.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error" and param in error["message"]
    assert handler.requests == []


def test_claude_code_and_reference_fields_are_accepted() -> None:
    handler = InProcess(PROTOCOL, THINK)
    extra = {
        "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
        "container": "cntr_1",
        "mcp_servers": [{"type": "url", "url": "https://example.invalid/mcp", "name": "x"}],
        "service_tier": "standard_only",
        "inference_geo": "us",
        "speed": "standard",
        "top_k": 20,
        "cache_control": {"type": "ephemeral"},
    }
    result = anthropic_client(handler).messages.create(
        model="demo",
        max_tokens=64,
        messages=HELLO,  # type: ignore[arg-type]
        metadata={"user_id": "u"},
        thinking={"type": "adaptive"},
        output_config={"effort": "xhigh"},
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        extra_body=extra,
    )
    assert result.content[-1].type == "text"
    req = handler.requests[0]
    assert req.sampling.top_k == 20 and req.parallel_tool_calls is False
    assert (req.reasoning.enabled, req.reasoning.effort) == (True, "high")


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_display_omitted_keeps_only_the_signature(stream: bool) -> None:
    thinking = {"type": "enabled", "budget_tokens": 2048, "display": "omitted"}
    if stream:
        events = frames(THINK, thinking=thinking)
        deltas = [d["delta"]["type"] for name, d in events if name == "content_block_delta"]
        assert "thinking_delta" not in deltas and "signature_delta" in deltas
        starts = [d["content_block"] for name, d in events if name == "content_block_start"]
        assert starts[0] == {"type": "thinking", "thinking": "", "signature": ""}
        return
    body = message_json(THINK, thinking=thinking)
    block = body["content"][0]
    assert block["type"] == "thinking" and block["thinking"] == ""
    assert block["signature"].startswith("pssig1_")
    assert body["content"][1] == {"type": "text", "text": "Hi!"}
    shown = message_json(THINK, thinking={"type": "enabled", "budget_tokens": 2048})
    assert shown["content"][0]["thinking"] == "Let me think."


def test_error_body_shape_for_a_refused_field() -> None:
    with pytest.raises(ApiError) as info:
        decode(output_config={"format": {"type": "json_schema"}})
    body = PROTOCOL.error_body(info.value)
    assert body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": info.value.message},
    }
    assert PROTOCOL.error_status(info.value) == 400
    json.dumps(body)


# ---------------------------------------------------------------- real pipeline (replay engine)


def replay_message(runtime: Any, body: dict[str, Any]) -> tuple[dict[str, Any], SdkMessage]:
    """(the JSON message, the SDK's accumulation of the streamed one) for one request."""
    body = {"model": "replay-qwen3", "max_tokens": 256, "messages": HELLO, **body}
    plain = PROTOCOL.encode_json(*replay_events(runtime, PROTOCOL, body, META.route))
    raw = b"".join(
        PROTOCOL.encode_stream(
            *replay_events(runtime, PROTOCOL, {**body, "stream": True}, META.route)
        )
    )
    return plain, anthropic_message(anthropic_events(raw))


def test_replay_tool_use_and_stop_sequence(qwen3_runtime: Any) -> None:
    plain, streamed = replay_message(
        qwen3_runtime,
        {
            "tools": [WEATHER],
            "mock_response": QWEN3_CALL,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
        },
    )
    plain_message = SdkMessage.model_validate(plain)
    assert (
        plain_message.usage == streamed.usage and plain_message.stop_reason == streamed.stop_reason
    )
    strip = [{k: v for k, v in b.model_dump().items() if k != "id"} for b in plain_message.content]
    assert strip == [
        {k: v for k, v in b.model_dump().items() if k != "id"} for b in streamed.content
    ]
    assert [b.type for b in streamed.content] == ["thinking", "text", "tool_use"]
    assert streamed.stop_reason == "tool_use" and streamed.content[2].input == {"city": "Paris"}  # type: ignore[union-attr]
    assert streamed.usage.service_tier == "standard" and streamed.usage.output_tokens > 0
    body = {"stop_sequences": ["END"], "mock_response": "Hello there END and more text"}
    plain, streamed = replay_message(qwen3_runtime, body)
    assert (plain["stop_reason"], plain["stop_sequence"]) == ("stop_sequence", "END")
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", "END")
    assert streamed.content[-1].text == "Hello there "  # type: ignore[union-attr]
