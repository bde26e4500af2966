"""Anthropic encoding behind the real qwen3 transform stages (thinking, tool_calls,
stop_sequences, built from pipelines/qwen3.yaml), fed token by token the way the generate
stage emits text.

The source is a scripted token stream (tests/api/helpers.py `scripted_pipeline`; the
generate stage and MLX are covered in tests/server and, with the replay engine, in the
conformance suite); everything after it is the real pipeline and the real SDK accumulation.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from anthropic.types import Message as SdkMessage

from pipeserve.api.anthropic_messages.protocol import AnthropicMessages
from pipeserve.api.base import RequestMeta
from tests.api.helpers import anthropic_events, anthropic_message, scripted_pipeline, split

PROTOCOL = AnthropicMessages()
WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}


def run(body: dict[str, Any], text: str, size: int, stream: bool) -> dict[str, Any]:
    events, ctx = scripted_pipeline("qwen3", PROTOCOL, body, split(text, size))
    if not stream:
        return SdkMessage.model_validate(PROTOCOL.encode_json(events, ctx)).model_dump()
    raw = b"".join(PROTOCOL.encode_stream(events, ctx))
    return anthropic_message(anthropic_events(raw)).model_dump()


def without_ids(message: dict[str, Any]) -> dict[str, Any]:
    """Call ids are random per generation (the tool stage's call_ ids)."""
    content = [
        {**block, "id": "-"} if block["type"] == "tool_use" else block
        for block in message["content"]
    ]
    return {**message, "content": content}


THINKING = {"type": "enabled", "budget_tokens": 1024}


def body(**fields: Any) -> dict[str, Any]:
    return {
        "model": "demo",
        "max_tokens": 256,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "thinking": THINKING,
        **fields,
    }


TOOL_TEXT = (
    "<think>\nThe user wants weather.\n</think>\n\nLet me check."
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": "3"}}\n</tool_call>'
)


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_thinking_text_and_tool_call(size: int) -> None:
    streamed = run(body(tools=[WEATHER]), TOOL_TEXT, size, stream=True)
    assert without_ids(streamed) == without_ids(
        run(body(tools=[WEATHER]), TOOL_TEXT, size, stream=False)
    )
    thinking, text, use = streamed["content"]
    assert thinking["thinking"] == "The user wants weather." and thinking["signature"]
    assert text == {"type": "text", "text": "Let me check.", "citations": None}
    assert (use["name"], use["input"]) == (
        "get_weather",
        {"city": "Paris", "days": 3},
    )  # coerced to the schema
    assert use["id"].startswith("toolu_")
    assert streamed["stop_reason"] == "tool_use"
    assert (streamed["usage"]["input_tokens"], streamed["usage"]["cache_read_input_tokens"]) == (
        34,
        16,
    )


@pytest.mark.parametrize("size", [1, 2, 5])
def test_stop_sequence_across_tokens(size: int) -> None:
    text = "<think>\n</think>\n\nkeep this STOP HERE not this"
    message = run(body(stop_sequences=["STOP HERE"]), text, size, stream=True)
    assert message == run(body(stop_sequences=["STOP HERE"]), text, size, stream=False)
    assert [block["type"] for block in message["content"]] == ["text"]
    assert message["content"][0]["text"] == "keep this "
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "STOP HERE")


def test_round_trip_history_decodes_our_own_output() -> None:
    first = run(body(tools=[WEATHER]), TOOL_TEXT, 4, stream=False)
    use = first["content"][2]
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {k: v for k, v in block.items() if v is not None} for block in first["content"]
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "sunny"}],
        },
    ]
    request = PROTOCOL.decode(
        body(tools=[WEATHER], messages=history), RequestMeta(route="/v1/messages")
    )
    assistant, tool = request.messages[1], request.messages[2]
    assert assistant.reasoning == "The user wants weather." and assistant.content == "Let me check."
    assert json.loads(assistant.tool_calls[0].arguments) == {"city": "Paris", "days": 3}
    assert (tool.role, tool.tool_call_id, tool.name, tool.content) == (
        "tool",
        use["id"],
        "get_weather",
        "sunny",
    )
