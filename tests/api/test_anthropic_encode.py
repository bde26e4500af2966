"""Anthropic Messages encoding: JSON message and SSE stream, checked with the anthropic SDK.

Every scenario is encoded both ways; the JSON must validate as `anthropic.types.Message`
and the SDK's own stream accumulation over our SSE bytes must give the same message.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from anthropic.types import Message as SdkMessage

from pipeserve.api.anthropic_messages.protocol import AnthropicMessages
from pipeserve.errors import ApiError
from pipeserve.events import (
    ContentDelta,
    ErrorEvent,
    Event,
    Finish,
    KeepAlive,
    PromptReady,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from pipeserve.request import GenerationRequest, Message
from pipeserve.stages.base import RequestContext
from tests.api.helpers import anthropic_events, anthropic_message, ctx_for

PROTOCOL = AnthropicMessages()


def make_ctx() -> RequestContext:
    request = GenerationRequest(model="demo", messages=[Message("user", "hi")])
    return ctx_for(request, "demo-model", "req_abc123", prompt_token_ids=[1] * 12)


def sse(events: Sequence[Event]) -> list[tuple[str | None, dict[str, Any]]]:
    return anthropic_events(b"".join(PROTOCOL.encode_stream(iter(events), make_ctx())))


def check_framing(frames: list[tuple[str | None, dict[str, Any]]]) -> None:
    """event: names match data types; blocks are strictly sequential; signature before stop."""
    names = [name for name, _ in frames if name != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    open_index, next_index, kind, signed = None, 0, None, False
    for name, data in frames:
        assert name == data["type"]
        if name == "content_block_start":
            assert open_index is None and data["index"] == next_index
            open_index, kind, signed = data["index"], data["content_block"]["type"], False
        elif name == "content_block_delta":
            assert data["index"] == open_index and not signed
            signed = data["delta"]["type"] == "signature_delta"
        elif name == "content_block_stop":
            assert data["index"] == open_index and (kind != "thinking" or signed)
            open_index, next_index = None, next_index + 1
    assert open_index is None


def encode_both(events: Sequence[Event]) -> dict[str, Any]:
    body = PROTOCOL.encode_json(iter(events), make_ctx())
    message = SdkMessage.model_validate(body)
    frames = sse(events)
    check_framing(frames)
    assert anthropic_message(frames).model_dump() == message.model_dump()
    json.dumps(body)  # JSON-serializable
    return body


TEXT = [
    PromptReady(12, 4),
    ContentDelta("Hel"),
    ContentDelta(""),
    ContentDelta("lo"),
    Finish("stop"),
    Usage(12, 3, 4),
]
THINK = [
    KeepAlive(),
    PromptReady(12),
    KeepAlive(),
    ReasoningDelta("Let me "),
    ReasoningDelta("think."),
    ContentDelta("Hi!"),
    Finish("stop"),
    Usage(12, 5, 0, reasoning_tokens=3),
]
TOOLS = [
    PromptReady(30),
    ContentDelta("Checking."),
    ToolCallStart(0, "call_abc", "get_weather"),
    ToolCallArgsDelta(0, '{"city": '),
    ToolCallArgsDelta(0, '"Paris"'),
    ToolCallEnd(0, '{"city": "Paris"}'),
    ToolCallStart(1, "call_def", "get_weather"),
    ToolCallEnd(1, '{"city": "Nice", "days": 3}'),
    Finish("tool_calls"),
    Usage(30, 20),
]


def test_text_message() -> None:
    body = encode_both(TEXT)
    assert body == {
        "id": "msg_req_abc123",
        "type": "message",
        "role": "assistant",
        "model": "demo-model",
        "content": [{"type": "text", "text": "Hello"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 8,
            "output_tokens": 3,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 4,
            "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
            "service_tier": "standard",
        },
    }


def test_thinking_then_text_has_signature() -> None:
    body = encode_both(THINK)
    thinking, text = body["content"]
    assert thinking["type"] == "thinking" and thinking["thinking"] == "Let me think."
    assert thinking["signature"].startswith("pssig1_") and len(thinking["signature"]) > 20
    assert text == {"type": "text", "text": "Hi!"}
    assert body["usage"]["output_tokens_details"] == {"thinking_tokens": 3}
    other = PROTOCOL.encode_json(
        iter([PromptReady(1), ReasoningDelta("Other."), Finish("stop"), Usage(1, 1)]), make_ctx()
    )
    assert other["content"][0]["signature"] != thinking["signature"]


def test_tool_calls() -> None:
    body = encode_both(TOOLS)
    assert body["content"] == [
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {"city": "Paris"}},
        {
            "type": "tool_use",
            "id": "toolu_def",
            "name": "get_weather",
            "input": {"city": "Nice", "days": 3},
        },
    ]
    assert body["stop_reason"] == "tool_use"


def test_tool_input_is_sent_once_validated() -> None:
    """Like Anthropic without the fine-grained streaming beta: input is buffered and
    validated, so the block starts when the call is complete, with one input_json_delta."""
    frames = sse(TOOLS)
    deltas = [d["delta"] for name, d in frames if name == "content_block_delta"]
    assert [d.get("partial_json") for d in deltas if d["type"] == "input_json_delta"] == [
        '{"city": "Paris"}',
        '{"city": "Nice", "days": 3}',
    ]
    starts = [d["content_block"] for name, d in frames if name == "content_block_start"]
    assert starts[1] == {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {}}


def test_long_held_call_keeps_the_stream_alive() -> None:
    fragments = [ToolCallArgsDelta(0, '{"text": "')] + [
        ToolCallArgsDelta(0, "x") for _ in range(200)
    ]
    events = [
        PromptReady(5),
        ToolCallStart(0, "call_x", "f"),
        *fragments,
        ToolCallArgsDelta(0, '"}'),
        ToolCallEnd(0, '{"text": "' + "x" * 200 + '"}'),
        Finish("tool_calls"),
        Usage(5, 9),
    ]
    frames = sse(events)
    assert sum(name == "ping" for name, _ in frames) >= 2
    assert encode_both(events)["content"][0]["input"] == {"text": "x" * 200}


def test_text_after_tool_call_and_remaining_arguments() -> None:
    events = [
        PromptReady(5),
        ToolCallStart(0, "toolu_x", "f"),
        ToolCallArgsDelta(0, '{"a"'),
        ToolCallEnd(0, '{"a": 1}'),
        ContentDelta("done"),
        Finish("tool_calls"),
        Usage(5, 9),
    ]
    body = encode_both(events)
    assert body["content"] == [
        {"type": "tool_use", "id": "toolu_x", "name": "f", "input": {"a": 1}},
        {"type": "text", "text": "done"},
    ]


def test_call_cut_at_max_tokens_is_text_not_a_tool_use() -> None:
    """A cut call never becomes a tool_use block whose input the SDK would repair into a
    plausible but wrong object ({"city": "Pa"}); its text is kept and stop_reason says why."""
    events = [
        PromptReady(5),
        ContentDelta("Sure."),
        ToolCallStart(0, "call_x", "f"),
        ToolCallArgsDelta(0, '{"city": "Pa'),
        ToolCallEnd(0, '{"city": "Pa'),
        Finish("length"),
        Usage(5, 4),
    ]
    body = encode_both(events)
    assert body["content"] == [{"type": "text", "text": 'Sure.{"city": "Pa'}]
    assert body["stop_reason"] == "max_tokens"


def test_malformed_call_is_text_and_ends_the_turn() -> None:
    events = [
        PromptReady(5),
        ToolCallStart(0, "call_x", "f"),
        ToolCallArgsDelta(0, '{"a" 1'),
        ToolCallEnd(0, '{"a" 1'),
        Finish("stop"),
        Usage(5, 4),
    ]
    body = encode_both(events)
    assert body["content"] == [{"type": "text", "text": '{"a" 1'}]
    assert body["stop_reason"] == "end_turn"


def test_valid_call_after_a_malformed_one() -> None:
    events = [
        PromptReady(5),
        ToolCallStart(0, "call_x", "f"),
        ToolCallEnd(0, "city=Paris"),
        ToolCallStart(1, "call_y", "f"),
        ToolCallArgsDelta(1, '{"a": 1}'),
        ToolCallEnd(1, '{"a": 1}'),
        Finish("tool_calls"),
        Usage(5, 4),
    ]
    body = encode_both(events)
    assert body["content"] == [
        {"type": "text", "text": "city=Paris"},
        {"type": "tool_use", "id": "toolu_y", "name": "f", "input": {"a": 1}},
    ]
    assert body["stop_reason"] == "tool_use"


@pytest.mark.parametrize(
    ("finish", "stop_reason", "stop_sequence"),
    [
        (Finish("length"), "max_tokens", None),
        (Finish("stop", stop_sequence="END"), "stop_sequence", "END"),
        (Finish("stop"), "end_turn", None),
    ],
)
def test_stop_reasons(finish: Finish, stop_reason: str, stop_sequence: str | None) -> None:
    body = encode_both([PromptReady(3), ContentDelta("x"), finish, Usage(3, 1)])
    assert (body["stop_reason"], body["stop_sequence"]) == (stop_reason, stop_sequence)


def test_empty_output_has_no_empty_blocks() -> None:
    body = encode_both([PromptReady(3), ContentDelta(""), Finish("stop"), Usage(3, 1)])
    assert body["content"] == [] and body["usage"]["output_tokens"] == 1


def test_message_start_waits_for_prompt_ready_and_carries_input_tokens() -> None:
    frames = sse(
        [
            KeepAlive(),
            KeepAlive(),
            PromptReady(40, 32),
            ContentDelta("a"),
            Finish("stop"),
            Usage(40, 1, 32),
        ]
    )
    assert [name for name, _ in frames[:3]] == ["ping", "ping", "message_start"]
    assert frames[0][1] == {"type": "ping"}
    usage = frames[2][1]["message"]["usage"]
    assert (usage["input_tokens"], usage["cache_read_input_tokens"], usage["output_tokens"]) == (
        8,
        32,
        0,
    )
    assert frames[-2][1]["usage"]["output_tokens"] == 1


def test_missing_usage_still_finishes() -> None:
    frames = sse([PromptReady(3), ContentDelta("a"), Finish("stop")])
    assert [name for name, _ in frames][-2:] == ["message_delta", "message_stop"]


def test_error_mid_stream_is_an_error_event() -> None:
    frames = sse(
        [
            PromptReady(3),
            ContentDelta("partial"),
            ErrorEvent("internal", "engine fault"),
            Finish("error"),
            Usage(3, 1),
        ]
    )
    assert frames[-1] == (
        "error",
        {"type": "error", "error": {"type": "api_error", "message": "engine fault"}},
    )
    assert "message_stop" not in [name for name, _ in frames]


def test_rest_of_the_stream_is_drained_and_generation_cancelled_after_an_error() -> None:
    seen: list[Event] = []
    ctx = make_ctx()

    def source() -> Iterator[Event]:
        for event in [PromptReady(3), ErrorEvent("internal", "boom"), Finish("error"), Usage(3, 1)]:
            seen.append(event)
            yield event

    frames = list(PROTOCOL.encode_stream(source(), ctx))
    assert frames[-1].startswith(b"event: error\n")
    assert seen[-1] == Usage(3, 1) and ctx.cancelled and ctx.cancel_reason == "error"


def test_error_before_output_raises_in_json_mode() -> None:
    with pytest.raises(ApiError) as exc:
        PROTOCOL.encode_json(
            iter(
                [KeepAlive(), ErrorEvent("internal", "engine fault"), Finish("error"), Usage(0, 0)]
            ),
            make_ctx(),
        )
    assert (exc.value.kind, exc.value.message) == ("internal", "engine fault")
    assert PROTOCOL.error_status(exc.value) == 500


def test_cancelled_stream_ends_without_message_stop() -> None:
    frames = sse([PromptReady(3), ContentDelta("a"), Finish("cancelled"), Usage(3, 1)])
    names = [name for name, _ in frames]
    assert "message_stop" not in names and "error" not in names


def test_stream_without_finish_is_an_error() -> None:
    frames = sse([PromptReady(3), ContentDelta("a")])
    assert frames[-1][0] == "error"


@pytest.mark.parametrize(
    ("kind", "status", "anthropic_type"),
    [
        ("invalid_request", 400, "invalid_request_error"),
        ("authentication", 401, "authentication_error"),
        ("permission", 403, "permission_error"),
        ("not_found", 404, "not_found_error"),
        ("too_large", 413, "request_too_large"),
        ("rate_limit", 429, "rate_limit_error"),
        ("overloaded", 529, "overloaded_error"),
        ("timeout", 504, "timeout_error"),
        ("internal", 500, "api_error"),
        ("unavailable", 503, "api_error"),
    ],
)
def test_error_bodies(kind: Any, status: int, anthropic_type: str) -> None:
    error = ApiError(kind, "what happened")
    assert PROTOCOL.error_status(error) == status
    assert PROTOCOL.error_body(error) == {
        "type": "error",
        "error": {"type": anthropic_type, "message": "what happened"},
    }


def test_sse_framing_helpers() -> None:
    from pipeserve.api.sse import sse_comment, sse_event

    assert (
        sse_event({"type": "ping", "text": "a\nb é"}, "ping")
        == 'event: ping\ndata: {"type":"ping","text":"a\\nb é"}\n\n'.encode()
    )
    assert sse_event("[DONE]") == b"data: [DONE]\n\n"
    assert sse_comment("keep-alive") == b": keep-alive\n\n"
    assert sse_comment() == b":\n\n"
