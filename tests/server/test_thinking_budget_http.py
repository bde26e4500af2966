"""Thinking budgets over HTTP with the official SDKs: a replay of a looping think block on
the qwen3 demo tokenizer (exact text) and real generation on the glm demo model (its
template opens the think block), on Chat, Responses, Messages and Ollama, streamed and
not, budgeted rows batched with unbudgeted ones."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.server.serverproc import REPO, server_process

pytestmark = pytest.mark.server

LOOP = "I should think more. "
ANSWER = "The answer is 4."
SCRIPT = "<think>\n" + LOOP * 300 + "</think>\n\n" + ANSWER  # 1500 tokens of thinking
ASK = [{"role": "user", "content": "What is 2+2?"}]
HARMONY = (
    "<|channel|>analysis<|message|>" + LOOP * 300
    + "<|end|><|start|>assistant<|channel|>final<|message|>" + ANSWER + "<|return|>"
)  # fmt: skip
MODELS = f"""\
  - name: loop
    source: demo:qwen3
    pipeline: qwen3
    engine: replay
    replay: {{completion: {json.dumps(SCRIPT)}}}
    reasoning: {{effort_budgets: {{low: 8, medium: 64}}}}
  - name: loop-kimi
    source: demo:kimi
    pipeline: kimi
    engine: replay
    replay: {{completion: {json.dumps(SCRIPT)}}}
    reasoning: {{effort_budgets: {{low: 8}}}}
  - name: capped
    source: demo:qwen3
    pipeline: qwen3
    engine: replay
    replay: {{completion: {json.dumps(SCRIPT)}}}
    reasoning: {{max_thinking_tokens: 16}}
  - name: loop-oss
    source: demo:gpt-oss
    pipeline: gpt-oss
    engine: replay
    replay: {{completion: {json.dumps(HARMONY)}}}
    reasoning: {{effort_budgets: {{low: 8}}}}
  - name: glm
    source: demo:glm
    pipeline: glm
    reasoning: {{max_thinking_tokens: 6}}
  - name: glm-free
    source: demo:glm
    pipeline: glm
    reasoning: {{effort_budgets: {{low: 6}}}}
"""
ENDPOINTS = """\
  - {route: /v1/chat/completions, api: openai-chat}
  - {route: /v1/messages, api: anthropic-messages}
  - {route: /v1/responses, api: openai-responses}
  - {route: /api, api: ollama}
"""


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = tmp_path_factory.mktemp("budget") / "budget.yaml"
    config.write_text(
        f"pipelines_dir: {REPO / 'pipelines'}\nmodels:\n{MODELS}endpoints:\n{ENDPOINTS}"
    )
    with server_process(config) as (url, _):
        yield url


@pytest.fixture(scope="module")
def chat(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0)


@cache
def _tokenizer(family: str = "qwen3") -> Any:
    """A demo vocabulary (what the replay models write with)."""
    from pipeserve.engine.weights.demo.build import ensure_demo_model
    from pipeserve.engine.weights.loader import load_tokenizer
    from pipeserve.settings import pipeserve_home

    return load_tokenizer(ensure_demo_model(family, pipeserve_home()))


def cut(budget: int) -> str:
    """The reasoning a budget leaves of the script: its first `budget` tokens inside the
    block (the newline after <think> is the first), as the thinking stage shows it."""
    ids = _tokenizer().encode("\n" + LOOP * 300, add_special_tokens=False)[:budget]
    return str(_tokenizer().decode(ids)).strip("\n")


def chat_answer(client: openai.OpenAI, stream: bool, **fields: Any) -> tuple[str, str, Any]:
    fields = {"model": "loop", "messages": ASK, "max_tokens": 4000, **fields}
    if not stream:
        reply = client.chat.completions.create(**fields)
        message = reply.choices[0].message
        return getattr(message, "reasoning_content", "") or "", message.content or "", reply.usage
    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **fields
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    return reasoning, "".join(d.content or "" for d in deltas), chunks[-1].usage


@pytest.mark.parametrize("stream", [False, True])
def test_chat_reasoning_effort_maps_to_the_model_s_budget(
    chat: openai.OpenAI, stream: bool
) -> None:
    reasoning, content, usage = chat_answer(chat, stream, reasoning_effort="low")
    assert reasoning == cut(8) and content == ANSWER
    # <think>, 8 tokens, </think>: what the usage counts as reasoning
    assert usage.completion_tokens_details.reasoning_tokens == 10
    full, content, _ = chat_answer(chat, stream, reasoning_effort="high")  # not in the table
    assert full == LOOP * 300 and content == ANSWER


def test_the_server_side_cap_applies_to_every_request(chat: openai.OpenAI) -> None:
    reasoning, content, _ = chat_answer(chat, False, model="capped")
    assert reasoning == cut(16) and content == ANSWER
    low, _, _ = chat_answer(chat, False, model="capped", reasoning_effort="low")
    assert low == cut(16)  # no table: the cap


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_budget_tokens(base: str, stream: bool) -> None:
    client = anthropic.Anthropic(base_url=base, api_key="k", max_retries=0)
    fields: dict[str, Any] = {
        "model": "loop",
        "max_tokens": 4000,
        "messages": ASK,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    if stream:
        with client.messages.stream(**fields) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**fields)
    thinking = [b.thinking for b in message.content if b.type == "thinking"]
    text = [b.text for b in message.content if b.type == "text"]
    assert thinking == [cut(1024)] and text == [ANSWER]
    assert message.stop_reason == "end_turn"


@pytest.mark.parametrize("stream", [False, True])
def test_responses_reasoning_effort(chat: openai.OpenAI, stream: bool) -> None:
    fields: dict[str, Any] = {
        "model": "loop",
        "input": "What is 2+2?",
        "reasoning": {"effort": "medium"},
    }
    if stream:
        with chat.responses.stream(**fields) as events:
            response = events.get_final_response()
    else:
        response = chat.responses.create(**fields)
    reasoning = [
        "".join(part.text for part in item.content or [])
        for item in response.output
        if item.type == "reasoning"
    ]
    assert reasoning == [cut(64)] and response.output_text == ANSWER
    assert (
        response.usage is not None and response.usage.output_tokens_details.reasoning_tokens == 66
    )


@pytest.mark.parametrize("stream", [False, True])
def test_gpt_oss_analysis_channel(chat: openai.OpenAI, stream: bool) -> None:
    """Harmony: the analysis message is closed and the final channel opened."""
    reasoning, content, usage = chat_answer(chat, stream, model="loop-oss", reasoning_effort="low")
    ids = _tokenizer("gpt-oss").encode(LOOP * 300, add_special_tokens=False)[:8]
    assert reasoning == _tokenizer("gpt-oss").decode(ids) and content == ANSWER


def test_kimi_think_block(chat: openai.OpenAI) -> None:
    reasoning, content, _ = chat_answer(chat, False, model="loop-kimi", reasoning_effort="low")
    ids = _tokenizer("kimi").encode("\n" + LOOP * 300, add_special_tokens=False)[:8]
    assert reasoning == _tokenizer("kimi").decode(ids).strip("\n") and content == ANSWER


@pytest.mark.mlx
@pytest.mark.parametrize("stream", [False, True])
def test_real_generation_on_messages_and_responses(base: str, stream: bool) -> None:
    """glm (template-opened block, max_thinking_tokens 6): Anthropic's budget and the
    Responses effort end the block after at most 6 tokens, and the model answers."""
    claude = anthropic.Anthropic(base_url=base, api_key="k", max_retries=0)
    fields: dict[str, Any] = {"model": "glm", "max_tokens": 24, "messages": ASK}
    fields |= {"extra_body": {"temperature": 0}}  # this SDK version has no temperature
    fields |= {"thinking": {"type": "enabled", "budget_tokens": 1024}}
    if stream:
        with claude.messages.stream(**fields) as events:
            message = events.get_final_message()
    else:
        message = claude.messages.create(**fields)
    thinking = "".join(b.thinking for b in message.content if b.type == "thinking")
    assert 0 < len(_tokenizer("glm").encode(thinking, add_special_tokens=False)) <= 6
    assert "".join(b.text for b in message.content if b.type == "text") != ""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0)
    asked: dict[str, Any] = {"model": "glm-free", "input": "What is 2+2?", "temperature": 0}
    asked |= {"reasoning": {"effort": "low"}, "max_output_tokens": 24}
    if stream:  # it ends at max_output_tokens: response.incomplete, not .completed
        *_, last = client.responses.create(stream=True, **asked)
        assert last.type in ("response.completed", "response.incomplete")
        response = last.response
    else:
        response = client.responses.create(**asked)
    assert response.usage is not None
    assert response.usage.output_tokens_details.reasoning_tokens <= 6 + 1
    assert response.output_text != ""


def test_ollama_think_levels(base: str) -> None:
    client = ollama.Client(host=base)
    answer = client.chat(model="loop", messages=ASK, think="low", options={"num_predict": 4000})
    assert answer.message.thinking == cut(8) and answer.message.content == ANSWER


def test_budgeted_and_unbudgeted_replays_together(chat: openai.OpenAI) -> None:
    efforts = ["low", "high", "medium", "high", "low"]
    with ThreadPoolExecutor(len(efforts)) as pool:
        answers = list(pool.map(lambda e: chat_answer(chat, True, reasoning_effort=e), efforts))
    expected = {"low": cut(8), "medium": cut(64), "high": LOOP * 300}
    assert [a[0] for a in answers] == [expected[e] for e in efforts]
    assert {a[1] for a in answers} == {ANSWER}


@pytest.mark.mlx
def test_real_generation_closes_the_block_and_answers(chat: openai.OpenAI) -> None:
    """glm's template opens the think block; a budget of 6 ends it after 6 tokens and
    the model answers (greedy), batched with unbudgeted rows as alone."""
    greedy = {"messages": ASK, "max_tokens": 24, "temperature": 0}

    def ask(model: str, effort: str | None, stream: bool = False) -> tuple[str, str, Any]:
        extra = {"reasoning_effort": effort} if effort else {}
        return chat_answer(chat, stream, model=model, **greedy, **extra)

    capped, capped_stream = ask("glm", None), ask("glm", None, stream=True)
    assert capped[:2] == capped_stream[:2]
    reasoning, content, usage = capped
    assert usage.completion_tokens_details.reasoning_tokens <= 6 + 1  # + </think>
    assert content != "" and usage.completion_tokens > 7
    free = ask("glm-free", None)
    assert free[2].completion_tokens_details.reasoning_tokens > 7  # the model thinks on
    alone = {e: ask("glm-free", e) for e in ("low", None)}
    assert alone["low"][:2] == capped[:2]  # effort low: 6 here too
    with ThreadPoolExecutor(4) as pool:
        batched = list(pool.map(lambda e: ask("glm-free", e), ["low", None, "low", None]))
    assert [b[:2] for b in batched] == [alone[e][:2] for e in ("low", None, "low", None)]


@pytest.mark.parametrize(
    ("budget", "words"),
    [(-5, "greater than or equal to 1024"), (1 << 30, "less than or equal to 16777216")],
)
def test_bad_budgets_are_a_400_naming_the_field(base: str, budget: int, words: str) -> None:
    body = {"model": "loop", "max_tokens": 10, "messages": ASK,
            "thinking": {"type": "enabled", "budget_tokens": budget}}  # fmt: skip
    reply = httpx.post(f"{base}/v1/messages", json=body, timeout=30)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and "thinking.budget_tokens" in error["message"]
    assert words in error["message"]


def test_validate_refuses_bad_budget_tables(tmp_path: Path) -> None:
    from pipeserve.config import load_server_config
    from pipeserve.config.problems import ConfigError

    config = tmp_path / "bad.yaml"
    config.write_text(
        f"pipelines_dir: {REPO / 'pipelines'}\nmodels:\n"
        "  - {name: m, source: 'demo:qwen3', pipeline: qwen3,"
        " reasoning: {max_thinking_tokens: -1, effort_budgets: {extreme: 4}}}\n"
        f"endpoints:\n{ENDPOINTS}"
    )
    with pytest.raises(ConfigError) as error:
        load_server_config(config)
    text = str(error.value)
    assert "models[0].reasoning.max_thinking_tokens" in text
    assert "models[0].reasoning.effort_budgets" in text
