"""Legacy OpenAI Completions (/v1/completions) with the openai SDK's completions API, on a
real server: replay models for exact text, the MLX demo model for logprobs and seeds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import pytest

pytestmark = pytest.mark.server

RAW = "<think>\nThe user greets me.\n</think>\n\nHello! How can I help you today?"


@pytest.fixture(scope="module")
def client(replay_server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{replay_server}/v1", api_key="test", max_retries=0)


def complete(client: openai.OpenAI, **fields: object) -> openai.types.Completion:
    fields.setdefault("model", "replay-qwen3")
    fields.setdefault("prompt", "Once upon a time")
    fields.setdefault("max_tokens", 100)
    return client.completions.create(**fields)  # type: ignore[call-overload,no-any-return]


def test_text_out_is_the_raw_model_text(client: openai.OpenAI) -> None:
    reply = complete(client)
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    [choice] = reply.choices
    assert choice.text == RAW  # no chat template, no reasoning split
    assert choice.finish_reason == "stop" and choice.logprobs is None
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_streaming_gives_the_same_text_and_usage(client: openai.OpenAI) -> None:
    chunks = list(complete(client, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert text == RAW and finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == complete(client).usage.completion_tokens  # type: ignore[union-attr]


def test_echo_stop_and_the_default_max_tokens(client: openai.OpenAI) -> None:
    echoed = complete(client, echo=True, prompt="Say: ")
    assert echoed.choices[0].text == "Say: " + RAW
    stopped = complete(client, stop=["me."])
    assert stopped.choices[0].text == "<think>\nThe user greets "
    assert stopped.choices[0].finish_reason == "stop"
    short = client.completions.create(model="replay-qwen3", prompt="x")  # max_tokens: 16
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 16  # type: ignore[union-attr]


def test_a_prompt_over_the_context_length_names_the_prompt(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        complete(client, prompt="word " * 60_000)  # replay-qwen3: 40960 tokens
    body = error.value.body
    assert body["code"] == "context_length_exceeded" and body["param"] == "prompt"  # type: ignore[index]


def test_token_id_prompts(client: openai.OpenAI, demo_tokenizer: Callable[[str], Any]) -> None:
    by_text = complete(client, prompt="Once upon a time")
    ids = list(demo_tokenizer("qwen3").encode("Once upon a time"))
    for prompt in (ids, [ids], ["Once upon a time"]):
        reply = complete(client, prompt=prompt)
        assert reply.choices[0].text == RAW
        assert reply.usage.prompt_tokens == by_text.usage.prompt_tokens  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"suffix": "def end():", "model": "replay-kimi"}, "suffix"),  # no FIM tokens
        ({"n": 0}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"logprobs": 6}, "logprobs"),
    ],
)
def test_unserved_fields_are_a_400_naming_them(
    client: openai.OpenAI, fields: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        complete(client, **fields)
    assert error.value.body["param"] == param  # type: ignore[index]
    if param == "suffix":
        assert "fill-in-the-middle" in error.value.body["message"]  # type: ignore[index]


@pytest.mark.mlx
def test_real_generation_logprobs_and_seed(demo_server: str) -> None:
    demo = openai.OpenAI(base_url=f"{demo_server}/v1", api_key="test", max_retries=0)
    runs = [
        demo.completions.create(
            model="demo", prompt="The sky is", max_tokens=6, logprobs=2, seed=7, temperature=1
        )
        for _ in range(2)
    ]
    assert runs[0].choices[0].text == runs[1].choices[0].text
    choice = runs[0].choices[0]
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert "".join(logprobs.tokens) == choice.text
    assert len(logprobs.tokens) == runs[0].usage.completion_tokens  # type: ignore[union-attr]
    assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs or [])
    offsets = [0]
    for token in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs.text_offset == offsets
    for token, tops in zip(logprobs.tokens, logprobs.top_logprobs or []):
        assert token in tops and 1 <= len(tops) <= 3
