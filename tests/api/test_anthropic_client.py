"""The official anthropic SDK against our protocol, in process.

The shared in-process handler (tests/api/helpers.py `InProcess`) hands each SDK request
to AnthropicMessages.decode and answers with encode_json / encode_stream over a scripted
event stream: the real SDK builds the
request bodies and parses our JSON and SSE (MessageStream, get_final_message, errors).
Server wiring is tested end to end in tests/server.
"""

from __future__ import annotations

import anthropic
import pytest

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
from pipeserve.request import Message, ToolCall
from pipeserve.stages.base import RequestContext
from tests.api.helpers import InProcess, anthropic_client

PROTOCOL = AnthropicMessages()
WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
HELLO = [{"role": "user", "content": "Say hello"}]
TEXT = [
    KeepAlive(),
    PromptReady(9),
    ContentDelta("Hello"),
    ContentDelta(" there!"),
    Finish("stop"),
    Usage(9, 3),
]
THINK = [
    PromptReady(9),
    ReasoningDelta("Let me "),
    ReasoningDelta("think."),
    ContentDelta("Hi!"),
    Finish("stop"),
    Usage(9, 6),
]
TOOL = [
    PromptReady(20),
    ReasoningDelta("Need weather."),
    ToolCallStart(0, "call_1", "get_weather"),
    ToolCallArgsDelta(0, '{"city": "Pa'),
    ToolCallArgsDelta(0, 'ris"}'),
    ToolCallEnd(0, '{"city": "Paris"}'),
    Finish("tool_calls"),
    Usage(20, 12),
]


@pytest.mark.parametrize("script", [TEXT, THINK, TOOL], ids=["text", "thinking", "tool"])
def test_stream_final_message_equals_create(script: list[Event]) -> None:
    handler = InProcess(PROTOCOL, script)
    sdk = anthropic_client(handler)
    created = sdk.messages.create(model="demo", max_tokens=64, messages=HELLO, tools=[WEATHER])
    with sdk.messages.stream(
        model="demo", max_tokens=64, messages=HELLO, tools=[WEATHER]
    ) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.model_dump() == created.model_dump()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert handler.requests[0].messages == [Message("user", "Say hello")]


def test_text_stream_and_usage() -> None:
    sdk = anthropic_client(InProcess(PROTOCOL, TEXT))
    with sdk.messages.stream(model="demo", max_tokens=64, messages=HELLO) as stream:
        assert "".join(stream.text_stream) == "Hello there!"
        final = stream.get_final_message()
    assert final.stop_reason == "end_turn" and final.model == "demo" and final.id.startswith("msg_")
    assert (final.usage.input_tokens, final.usage.output_tokens) == (9, 3)


def test_thinking_events_and_signature() -> None:
    sdk = anthropic_client(InProcess(PROTOCOL, THINK))
    with sdk.messages.stream(
        model="demo",
        max_tokens=4096,
        messages=HELLO,
        thinking={"type": "enabled", "budget_tokens": 1024},
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "thinking" in kinds and "signature" in kinds
    assert final.content[0].type == "thinking" and final.content[0].thinking == "Let me think."
    assert final.content[0].signature


def test_tool_round_trip_through_the_sdk() -> None:
    handler = InProcess(PROTOCOL, TOOL)
    sdk = anthropic_client(handler)
    first = sdk.messages.create(
        model="demo",
        max_tokens=256,
        messages=HELLO,
        tools=[WEATHER],
        tool_choice={"type": "any"},
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    use = first.content[1]
    assert first.stop_reason == "tool_use" and use.type == "tool_use"
    assert use.id.startswith("toolu_") and use.input == {"city": "Paris"}
    history = [
        *HELLO,
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],
        },
    ]
    handler.script = TEXT
    second = sdk.messages.create(model="demo", max_tokens=64, messages=history, tools=[WEATHER])  # type: ignore[arg-type]
    assert second.content[0].text == "Hello there!"  # type: ignore[union-attr]
    replayed = handler.requests[1].messages
    assert replayed[1] == Message(
        "assistant",
        "",
        reasoning="Need weather.",
        tool_calls=[ToolCall(use.id, "get_weather", '{"city": "Paris"}')],
    )
    assert replayed[2] == Message("tool", "sunny", tool_call_id=use.id, name="get_weather")


def test_error_mid_stream_raises_in_the_sdk() -> None:
    sdk = anthropic_client(
        InProcess(
            PROTOCOL,
            [
                PromptReady(3),
                ContentDelta("par"),
                ErrorEvent("internal", "engine fault"),
                Finish("error"),
                Usage(3, 1),
            ],
        )
    )
    with pytest.raises(anthropic.APIStatusError) as exc:
        with sdk.messages.stream(model="demo", max_tokens=64, messages=HELLO) as stream:
            stream.get_final_message()
    assert exc.value.body == {
        "type": "error",
        "error": {"type": "api_error", "message": "engine fault"},
    }


def test_bad_request_is_a_400_with_anthropic_shape() -> None:
    sdk = anthropic_client(InProcess(PROTOCOL, TEXT))
    with pytest.raises(anthropic.BadRequestError) as exc:
        # this SDK version no longer has a temperature argument; older clients still send it
        sdk.messages.create(
            model="demo", max_tokens=64, messages=HELLO, extra_body={"temperature": 3.0}
        )
    assert exc.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "temperature: Input should be less than or equal to 1",
        },
    }


def test_overloaded_is_529() -> None:
    def queue_full(ctx: RequestContext) -> list[Event]:
        raise ApiError("overloaded", "queue is full")  # as the server's admission says

    sdk = anthropic_client(InProcess(PROTOCOL, queue_full))
    with pytest.raises(anthropic.OverloadedError) as exc:
        sdk.messages.create(model="demo", max_tokens=64, messages=HELLO)
    assert exc.value.status_code == 529 and exc.value.type == "overloaded_error"  # type: ignore[attr-defined]


def test_count_tokens() -> None:
    handler = InProcess(PROTOCOL, TEXT)
    result = anthropic_client(handler).messages.count_tokens(
        model="demo", messages=HELLO, system="Be brief.", tools=[WEATHER]
    )
    assert result.input_tokens == 42
    assert handler.requests[0].messages == [
        Message("system", "Be brief."),
        Message("user", "Say hello"),
    ]
    assert [tool.name for tool in handler.requests[0].tools] == ["get_weather"]
