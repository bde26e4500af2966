"""OpenAI Chat Completions through the official SDK against a real replay server."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from tests.server.scenarios import FAMILIES, WEATHER_TOOL_SCHEMA, Family

pytestmark = pytest.mark.server

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": WEATHER_TOOL_SCHEMA,
        },
    }
]
HELLO = [{"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def client(replay_server: str) -> OpenAI:
    return OpenAI(base_url=f"{replay_server}/v1", api_key="test", max_retries=0)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.model)
def test_plain_text(client: OpenAI, family: Family) -> None:
    result = client.chat.completions.create(
        model=family.model, messages=HELLO, extra_body={"mock_response": family.text}
    )
    assert result.object == "chat.completion"
    assert result.choices[0].message.content == "Hello there!"
    assert result.choices[0].finish_reason == "stop"
    assert (
        result.usage is not None
        and result.usage.prompt_tokens > 0
        and result.usage.completion_tokens > 0
    )


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.model)
def test_reasoning_non_streaming(client: OpenAI, family: Family) -> None:
    result = client.chat.completions.create(
        model=family.model, messages=HELLO, extra_body={"mock_response": family.reasoning}
    )
    message = result.choices[0].message
    assert message.content == "Hello there!"
    assert message.reasoning_content.strip() == "Let me think."
    assert result.usage.completion_tokens_details.reasoning_tokens > 0


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.model)
def test_stream_with_usage(client: OpenAI, family: Family) -> None:
    stream = client.chat.completions.create(
        model=family.model,
        messages=HELLO,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"mock_response": family.reasoning},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    assert text == "Hello there!"
    assert reasoning.strip() == "Let me think."
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.model)
def test_tool_call_and_round_trip(client: OpenAI, family: Family) -> None:
    first = client.chat.completions.create(
        model=family.model,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS,
        extra_body={"mock_response": family.tool_call},
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'},
    ]
    second = client.chat.completions.create(
        model=family.model,
        messages=history,
        tools=TOOLS,
        extra_body={"mock_response": family.after_tool},
    )
    assert second.choices[0].message.content == "It is sunny in Paris."
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.model)
def test_streamed_tool_call_accumulates(client: OpenAI, family: Family) -> None:
    with client.chat.completions.stream(
        model=family.model,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS,
        extra_body={"mock_response": family.tool_call},
    ) as stream:
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    assert final.choices[0].finish_reason == "tool_calls"


def test_mock_header(client: OpenAI) -> None:
    result = client.chat.completions.create(
        model="replay-qwen3",
        messages=HELLO,
        extra_headers={"X-Mock-Response": '"<think>\\n</think>\\n\\nline one\\nline two"'},
    )
    assert result.choices[0].message.content == "line one\nline two"


def test_stop_sequence(client: OpenAI) -> None:
    result = client.chat.completions.create(
        model="replay-qwen3",
        messages=HELLO,
        stop=["STOP HERE"],
        extra_body={"mock_response": "<think>\n</think>\n\nkeep this STOP HERE not this"},
    )
    assert result.choices[0].message.content == "keep this "
    assert result.choices[0].finish_reason == "stop"


def test_models_list(client: OpenAI) -> None:
    names = {m.id for m in client.models.list()}
    assert {"replay-qwen3", "replay-gpt-oss", "replay-glm", "replay-kimi"} <= names
