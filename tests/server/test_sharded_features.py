"""Everything on sharded models (2 local ranks each), through the HTTP API: structured
output and the prefix cache (lockstep.py), several sharded models in one server, and a
sharded model loaded on demand (each in a shard host of its own, server/remote/host.py).

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
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from openai import OpenAI

from tests.server.serverproc import REPO, server_process
from tests.server.structured_cases import SCHEMA, assert_valid, metric, sample_all
from tests.server.test_sharded import peer_pids
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
        "  - name: split2\n    source: 'demo:qwen3'\n    pipeline: qwen3\n"
        "    options: {sharding: {strategy: tensor, ranks: 2}}\n"
        "  - name: lazy\n    source: 'demo:qwen3'\n    pipeline: qwen3\n"
        "    load: on_demand\n    keep_alive: 3\n"
        "    options: {sharding: {strategy: tensor, ranks: 2}}\n"
        "endpoints:\n  - {route: /v1/chat/completions, api: openai-chat}\n"
    )
    with server_process(config, startup_timeout=300) as (base, proc):
        SERVER["pid"] = proc.pid
        yield OpenAI(base_url=f"{base}/v1", api_key="test", max_retries=0, timeout=300)


SERVER: dict[str, int] = {}


def ranks_of(model: str) -> list[int]:
    """The rank processes (other than rank 0) of one sharded model of the server."""
    pids = peer_pids(SERVER["pid"])
    return [p for p in pids if f"--model={model}\0" in Path(f"/proc/{p}/cmdline").read_text()]


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


def test_two_sharded_models_serve_at_once(client: OpenAI) -> None:
    prompts = [("split", "Say hello"), ("split2", "Say hello"), ("split", "Count to five"),
               ("split2", "Count to five")]  # fmt: skip
    answers = sample_all(lambda i: chat(client, prompts[i][0], prompts[i][1])[0], len(prompts))
    for (_, prompt), got in zip(prompts, answers, strict=True):
        assert got == chat(client, "plain", prompt)[0]
    assert ranks_of("split") and ranks_of("split2")


def test_a_sharded_model_loads_on_demand_and_again_after_keep_alive(client: OpenAI) -> None:
    assert ranks_of("lazy") == []  # nothing placed before its first request
    expected = chat(client, "plain", "Say hello")[0]
    assert chat(client, "lazy", "Say hello")[0] == expected
    first = ranks_of("lazy")
    assert len(first) == 1
    deadline = time.monotonic() + 90  # keep_alive 3 s, then the shard host is replaced
    while ranks_of("lazy") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ranks_of("lazy") == []
    again = wait_for_answer(client, "lazy", "Say hello")
    assert again == expected and ranks_of("lazy") not in ([], first)


def wait_for_answer(client: OpenAI, model: str, prompt: str) -> str:
    """The answer once the model's (restarted) shard host takes requests again."""
    deadline = time.monotonic() + 120
    while True:
        try:
            return chat(client, model, prompt)[0]
        except (KeyError, httpx.HTTPError):
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
