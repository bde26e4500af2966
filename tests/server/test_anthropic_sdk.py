"""Anthropic Messages through the official SDK against a real replay server."""

from __future__ import annotations

import pytest
from anthropic import Anthropic

from tests.server.scenarios import FAMILIES, WEATHER_TOOL_SCHEMA, Family

pytestmark = pytest.mark.server

TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather for a city",
        "input_schema": WEATHER_TOOL_SCHEMA,
    }
]
HELLO = [{"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def client(replay_server: str) -> Anthropic:
    return Anthropic(base_url=replay_server, api_key="test", max_retries=0)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.model)
def test_plain_text(client: Anthropic, family: Family) -> None:
    message = client.messages.create(
        model=family.model, max_tokens=64, messages=HELLO, extra_body={"mock_response": family.text}
    )
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == "Hello there!"
    assert message.stop_reason == "end_turn"
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.model)
def test_thinking_streamed_equals_final(client: Anthropic, family: Family) -> None:
    with client.messages.stream(
        model=family.model,
        max_tokens=64,
        messages=HELLO,
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"mock_response": family.reasoning},
    ) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking.strip() == "Let me think."
    assert final.content[0].signature
    assert final.content[1].text == "Hello there!"
    assert final.usage.input_tokens > 0


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.model)
def test_no_thinking_block_unless_asked(client: Anthropic, family: Family) -> None:
    """A model that reasons anyway (the script does) shows no thinking block when the
    request does not enable thinking; its tokens still count in usage."""
    asked = {"type": "enabled", "budget_tokens": 1024}
    mock = {"mock_response": family.reasoning}
    with client.messages.stream(
        model=family.model, max_tokens=64, messages=HELLO, extra_body=mock
    ) as stream:
        streamed = stream.get_final_message()
    plain = client.messages.create(
        model=family.model, max_tokens=64, messages=HELLO, extra_body=mock
    )
    shown = client.messages.create(
        model=family.model, max_tokens=64, messages=HELLO, thinking=asked, extra_body=mock
    )
    for message in (streamed, plain):
        assert [(b.type, b.text) for b in message.content] == [("text", "Hello there!")]  # type: ignore[union-attr]
        assert message.usage.output_tokens == shown.usage.output_tokens
    assert [b.type for b in shown.content] == ["thinking", "text"]


def test_qwen3_template_renders_thinking_off_unless_asked(client: Anthropic) -> None:
    """Qwen3's template closes an empty think block when thinking is off (its
    enable_thinking switch, named in pipelines/qwen3.yaml): the prompt is longer."""
    count = client.messages.count_tokens
    off = count(model="replay-qwen3", messages=HELLO).input_tokens
    on = count(
        model="replay-qwen3", messages=HELLO, thinking={"type": "enabled", "budget_tokens": 1024}
    ).input_tokens
    assert off > on


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.model)
def test_tool_use_round_trip(client: Anthropic, family: Family) -> None:
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.messages.create(
        model=family.model,
        max_tokens=256,
        messages=ask,
        tools=TOOLS,
        extra_body={"mock_response": family.tool_call},
    )
    assert first.stop_reason == "tool_use"
    use = next(b for b in first.content if b.type == "tool_use")
    assert use.name == "get_weather" and use.input == {"city": "Paris", "days": 3}
    history = [
        *ask,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],
        },
    ]
    second = client.messages.create(
        model=family.model,
        max_tokens=64,
        messages=history,
        tools=TOOLS,
        extra_body={"mock_response": family.after_tool},
    )
    assert second.content[-1].text == "It is sunny in Paris."
    assert second.usage.input_tokens > first.usage.input_tokens


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.model)
def test_streamed_tool_use(client: Anthropic, family: Family) -> None:
    with client.messages.stream(
        model=family.model,
        max_tokens=256,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS,
        extra_body={"mock_response": family.tool_call},
    ) as stream:
        final = stream.get_final_message()
    use = next(b for b in final.content if b.type == "tool_use")
    assert use.input == {"city": "Paris", "days": 3}
    assert final.stop_reason == "tool_use"


def test_stop_sequence_reported(client: Anthropic) -> None:
    message = client.messages.create(
        model="replay-qwen3",
        max_tokens=64,
        messages=HELLO,
        stop_sequences=["STOP HERE"],
        extra_body={"mock_response": "<think>\n</think>\n\nkeep this STOP HERE not this"},
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "STOP HERE"
    assert message.content[0].text == "keep this "


def test_max_tokens_stop_reason(client: Anthropic) -> None:
    message = client.messages.create(
        model="replay-qwen3",
        max_tokens=3,
        messages=HELLO,
        extra_body={"mock_response": "<think>\n</think>\n\none two three four five six seven"},
    )
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 3


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.model)
def test_count_tokens_matches_usage(client: Anthropic, family: Family) -> None:
    counted = client.messages.count_tokens(model=family.model, messages=HELLO, tools=TOOLS)
    message = client.messages.create(
        model=family.model,
        max_tokens=16,
        messages=HELLO,
        tools=TOOLS,
        extra_body={"mock_response": family.text},
    )
    assert counted.input_tokens == message.usage.input_tokens + (
        message.usage.cache_read_input_tokens or 0
    )


def test_models_list_and_retrieve(client: Anthropic) -> None:
    """`/v1/models` serves both SDKs: the Anthropic one pages on has_more/last_id."""
    models = list(client.models.list())
    assert [m.id for m in models][:2] == ["replay-qwen3", "replay-gpt-oss"]
    assert all(m.type == "model" and m.display_name for m in models)
    assert client.models.retrieve("replay-glm").id == "replay-glm"
