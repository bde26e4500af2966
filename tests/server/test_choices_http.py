"""`n` choices on Chat and Completions with the openai SDK on real servers: each seeded
choice is the single answer of its seed stream (seed + index), the choices are prefilled
once (the server's prefill counters), streamed chunks are interleaved by index, usage
counts the prompt once; replay models for the parsed shapes (reasoning, tool calls)."""

from __future__ import annotations

import re
import uuid
from typing import Any

import httpx
import openai
import pytest

pytestmark = pytest.mark.server

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0)


def counter(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    match = re.search(rf'^{name}{{model="demo"}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


@pytest.mark.mlx
def test_seeded_choices_prefilled_once_equal_single_answers(demo_server: str) -> None:
    demo = client(demo_server)
    messages = [{"role": "user", "content": f"Tell me a story, {uuid.uuid4().hex}"}]
    fields: dict[str, Any] = {"model": "demo", "messages": messages, "temperature": 1.0}
    fields["max_tokens"] = 10
    before = [
        counter(demo_server, m)
        for m in ("pipeserve_prefill_tokens", "pipeserve_shared_prompt_rows")
    ]
    reply = demo.chat.completions.create(n=4, seed=7, **fields)
    after = [
        counter(demo_server, m)
        for m in ("pipeserve_prefill_tokens", "pipeserve_shared_prompt_rows")
    ]
    assert reply.usage is not None
    prompt = reply.usage.prompt_tokens
    assert after[0] - before[0] == prompt + 3  # one prefill, then one token per other choice
    assert after[1] - before[1] == 3
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    singles = [demo.chat.completions.create(seed=7 + i, **fields) for i in range(4)]
    assert [c.message.content for c in reply.choices] == [
        s.choices[0].message.content for s in singles
    ]
    assert len({c.message.content for c in reply.choices}) == 4
    assert reply.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)  # type: ignore[union-attr]
    assert reply.usage.total_tokens == prompt + reply.usage.completion_tokens
    chunks = list(
        demo.chat.completions.create(
            n=4, seed=7, stream=True, stream_options={"include_usage": True}, **fields
        )
    )
    texts: dict[int, str] = {}
    finishes: dict[int, str | None] = {}
    order = [c.choices[0].index for c in chunks if c.choices]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    assert [texts[i] for i in range(4)] == [c.message.content for c in reply.choices]
    assert finishes == {i: "length" for i in range(4)}
    assert order.index(3) < len(order) - order[::-1].index(0) - 1  # interleaved, not in turn
    usage = chunks[-1].usage
    assert len({c.id for c in chunks}) == 1 and usage is not None
    counts = (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)
    assert counts == (prompt, reply.usage.completion_tokens, reply.usage.total_tokens)


@pytest.mark.mlx
def test_completions_choices(demo_server: str) -> None:
    demo = client(demo_server)
    fields: dict[str, Any] = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 8}
    fields["temperature"] = 1.0
    reply = demo.completions.create(n=3, seed=11, **fields)
    singles = [demo.completions.create(seed=11 + i, **fields).choices[0].text for i in range(3)]
    assert [c.text for c in reply.choices] == singles and [c.index for c in reply.choices] == [
        0,
        1,
        2,
    ]
    streamed: dict[int, str] = {}
    for chunk in demo.completions.create(n=3, seed=11, stream=True, **fields):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(3)] == singles
    assert reply.usage is not None and reply.usage.completion_tokens == 24


def test_each_choice_is_parsed_on_its_own(replay_server: str) -> None:
    replay = client(replay_server)
    mock = {"mock_response": "<think>\nWeather.\n</think>\n\n" + CALL}
    fields: dict[str, Any] = {"model": "replay-qwen3", "tools": [WEATHER], "extra_body": mock}
    fields["messages"] = [{"role": "user", "content": "Weather in Paris?"}]
    reply = replay.chat.completions.create(n=3, **fields)
    assert [c.finish_reason for c in reply.choices] == ["tool_calls"] * 3
    for choice in reply.choices:
        [call] = choice.message.tool_calls or []
        assert call.function.name == "get_weather"  # type: ignore[union-attr]
        assert getattr(choice.message, "reasoning_content", None) == "Weather."
    with replay.chat.completions.stream(n=2, **fields) as events:
        final = events.get_final_completion()
    assert [c.message.tool_calls[0].function.name for c in final.choices] == ["get_weather"] * 2  # type: ignore[index]


def test_more_choices_than_the_model_admits_is_a_400(demo_server: str) -> None:
    body = {"model": "demo", "n": 41, "max_tokens": 2}
    body["messages"] = [{"role": "user", "content": "hi"}]
    reply = httpx.post(f"{demo_server}/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "n"
    assert "at most 40" in reply.json()["error"]["message"]  # max_batch 8 + queue_size 32


@pytest.mark.parametrize(
    ("n", "path"),
    [(0, "chat"), (1000, "chat"), ("2", "chat"), (0, "completions"), (129, "completions")],
)
def test_bad_n_is_a_400_naming_it(replay_server: str, n: Any, path: str) -> None:
    body: dict[str, Any] = {"model": "replay-qwen3", "n": n, "max_tokens": 4}
    body |= (
        {"messages": [{"role": "user", "content": "hi"}]} if path == "chat" else {"prompt": "hi"}
    )
    reply = httpx.post(
        f"{replay_server}/v1/{path}/completions"
        if path == "chat"
        else f"{replay_server}/v1/completions",
        json=body,
        timeout=30,
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "n"
