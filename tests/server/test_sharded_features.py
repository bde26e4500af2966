"""Structured output and the prefix cache on a sharded model (2 local ranks, pipeline),
through the HTTP API (lockstep.py).

Structured output: every rank compiles the request's grammar and masks for itself.
Greedy constrained answers equal the unsharded model's token for token; sampled answers
(temperature 1, several in one batch) all validate, and so do strict tool calls: a rank
that masked differently would sample another token and break the lockstep, so the group
staying healthy is part of what is checked.

Prefix cache: a repeated prompt hits on the sharded model and its greedy answer is
unchanged; with a budget of a few entries, rank 0's trims keep every rank's cache equal
(a rank that found another cached length would end the group).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from openai import OpenAI

from tests.server.serverproc import REPO, running_server
from tests.server.structured_cases import SCHEMA, assert_valid, metric, sample_all
from tests.server.test_strict_tools import ARGS, ASK, TOOL_CALL, chat_tool

pytestmark = [pytest.mark.sharded, pytest.mark.server, pytest.mark.mlx]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAI]:
    config = tmp_path_factory.mktemp("sharded-structured") / "config.yaml"
    config.write_text(
        f"pipelines_dir: {REPO / 'pipelines'}\n"
        "models:\n"
        "  - {name: plain, source: 'demo:qwen3', pipeline: qwen3}\n"
        "  - name: split\n    source: 'demo:qwen3'\n    pipeline: qwen3\n"
        "    options:\n      sharding: {strategy: pipeline, ranks: 2}\n"
        "      prefix_cache: {max_bytes: 400000, min_tokens: 16}\n"
        "endpoints:\n  - {route: /v1/chat/completions, api: openai-chat}\n"
    )
    with running_server(config, startup_timeout=300) as base:
        yield OpenAI(base_url=f"{base}/v1", api_key="test", max_retries=0, timeout=300)


def base_url(client: OpenAI) -> str:
    return str(client.base_url).removesuffix("/").removesuffix("/v1")


def chat(client: OpenAI, model: str, prompt: str) -> tuple[str, int]:
    """(greedy answer, prompt tokens reused from the prefix cache)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 12, "temperature": 0}  # fmt: skip
    reply = httpx.post(f"{base_url(client)}/v1/chat/completions", json=body, timeout=300).json()
    details = reply["usage"].get("prompt_tokens_details") or {}
    return reply["choices"][0]["message"]["content"], int(details.get("cached_tokens") or 0)


def ticket(client: OpenAI, model: str, **sampling: Any) -> str | None:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "A ticket, please"}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "ticket", "schema": SCHEMA, "strict": True}},
        max_tokens=120, reasoning_effort="none", **sampling,
    )  # fmt: skip
    return reply.choices[0].message.content


def test_greedy_json_schema_answer_equals_unsharded_and_validates(client: OpenAI) -> None:
    split = ticket(client, "split", temperature=0)
    assert split == ticket(client, "plain", temperature=0)
    assert_valid(split)


def test_sampled_json_schema_answers_in_one_batch_all_validate(client: OpenAI) -> None:
    for text in sample_all(lambda _: ticket(client, "split", temperature=1.0), 6):
        assert_valid(text)


def test_strict_tool_calls_validate_and_the_group_stays_healthy(client: OpenAI) -> None:
    def ask(_: int) -> list[Any]:
        reply = client.chat.completions.create(
            model="split", messages=ASK, tools=[chat_tool(ARGS, True)], tool_choice="auto",
            temperature=1.0, max_tokens=64, logit_bias={str(TOOL_CALL): 30},
            reasoning_effort="none",
        )  # fmt: skip
        return reply.choices[0].message.tool_calls or []

    calls = [call for answer in sample_all(ask, 4) for call in answer]
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), ARGS)
    health = httpx.get(f"{base_url(client)}/health", timeout=10)
    assert health.status_code == 200, health.text


LONG = "Tell me a long story about a lighthouse keeper and the sea, in the old style: "


def test_a_repeated_prompt_hits_the_prefix_cache_and_answers_the_same(client: OpenAI) -> None:
    expected, _ = chat(client, "plain", LONG + "first")
    first, _ = chat(client, "split", LONG + "first")
    again, cached = chat(client, "split", LONG + "first")
    assert first == again == expected
    assert cached > 16


def test_trims_keep_the_ranks_caches_equal(client: OpenAI) -> None:
    """Prompts that do not fit the budget together: entries are evicted on every rank
    alike, so later hits and misses agree and answers stay equal to the unsharded ones."""
    prompts = [LONG + word for word in ("one", "two", "three", "four", "one", "three")]
    for prompt in prompts:
        assert chat(client, "split", prompt)[0] == chat(client, "plain", prompt)[0]
    # rank 0 holds 1 of the 2 layers: its cache, doubled, stays within the budget
    assert 0 < metric(base_url(client), "pipeserve_prefix_cache_bytes", "split") * 2 <= 400_000
    assert metric(base_url(client), "pipeserve_prefix_cache_hits", "split") >= 2
    assert httpx.get(f"{base_url(client)}/health", timeout=10).status_code == 200
