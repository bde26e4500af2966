"""The same client paths on the real MLX demo model (random weights: structure, not
meaning, is asserted), proving the path with actual generation."""

from __future__ import annotations

import pytest
from anthropic import Anthropic
from openai import OpenAI

from tests.server.scenarios import WEATHER_TOOL_SCHEMA

pytestmark = [pytest.mark.server, pytest.mark.mlx]

CHAT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_TOOL_SCHEMA}}
]
HELLO = [{"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def openai_client(demo_server: str) -> OpenAI:
    return OpenAI(base_url=f"{demo_server}/v1", api_key="test", max_retries=0)


@pytest.fixture(scope="module")
def anthropic_client(demo_server: str) -> Anthropic:
    return Anthropic(base_url=demo_server, api_key="test", max_retries=0)


def test_chat_greedy_is_deterministic_and_counted(openai_client: OpenAI) -> None:
    runs = [
        openai_client.chat.completions.create(
            model="demo", messages=HELLO, max_tokens=12, temperature=0
        )
        for _ in range(2)
    ]
    first, second = runs
    assert first.choices[0].message.content == second.choices[0].message.content
    assert first.choices[0].finish_reason in {"stop", "length"}
    assert 0 < first.usage.completion_tokens <= 12 and first.usage.prompt_tokens > 5


def test_chat_stream_matches_non_stream(openai_client: OpenAI) -> None:
    plain = openai_client.chat.completions.create(
        model="demo", messages=HELLO, max_tokens=12, temperature=0
    )
    stream = openai_client.chat.completions.create(
        model="demo",
        messages=HELLO,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (plain.choices[0].message.content or "")
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_chat_forced_tool_choice_and_round_trip(openai_client: OpenAI) -> None:
    forced = openai_client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "Weather?"}],
        tools=CHAT_TOOLS,
        max_tokens=16,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
    )
    assert forced.choices[0].finish_reason in {"tool_calls", "length", "stop"}
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    answer = openai_client.chat.completions.create(
        model="demo", messages=history, tools=CHAT_TOOLS, max_tokens=8
    )
    assert answer.usage.prompt_tokens > forced.usage.prompt_tokens - 5


def test_anthropic_create_stream_and_count(anthropic_client: Anthropic) -> None:
    greedy = {"temperature": 0}  # the 2.x SDK dropped the sampling arguments; the API keeps them
    message = anthropic_client.messages.create(
        model="demo", max_tokens=10, messages=HELLO, extra_body=greedy
    )
    assert message.stop_reason in {"end_turn", "max_tokens"}
    with anthropic_client.messages.stream(
        model="demo", max_tokens=10, messages=HELLO, extra_body=greedy
    ) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in message.content]
    counted = anthropic_client.messages.count_tokens(model="demo", messages=HELLO)
    assert counted.input_tokens == message.usage.input_tokens + (
        message.usage.cache_read_input_tokens or 0
    )


def test_responses_create_and_stream(openai_client: OpenAI) -> None:
    response = openai_client.responses.create(
        model="demo", input="Say hello", max_output_tokens=10, temperature=0
    )
    assert response.status in {"completed", "incomplete"}
    # At max_output_tokens the stream ends with response.incomplete, on which the SDK's
    # get_final_response() raises (as against OpenAI): take the terminal event instead.
    with openai_client.responses.stream(
        model="demo", input="Say hello", max_output_tokens=10, temperature=0
    ) as stream:
        terminal = [e for e in stream if e.type in {"response.completed", "response.incomplete"}]
    assert len(terminal) == 1
    final = terminal[0].response
    assert final.status == response.status
    assert final.output_text == response.output_text
    assert final.usage.output_tokens == response.usage.output_tokens


def test_chat_logprobs_from_the_real_engine(openai_client: OpenAI) -> None:
    result = openai_client.chat.completions.create(
        model="demo",
        messages=HELLO,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        reasoning_effort="none",
    )
    entries = result.choices[0].logprobs.content
    assert len(entries) == result.usage.completion_tokens
    assert "".join(e.token for e in entries) == result.choices[0].message.content
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        # Greedy: the sampled token is the most likely one.
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
