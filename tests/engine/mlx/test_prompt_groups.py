"""A request's n choices as one prompt group: prefilled once (the leader's prompt KV is
copied to the others, the prefill counter shows it), each choice exactly what it gives
alone with its own seed, cancels and a leader that goes away handled."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pipeserve.config.models import PrefixCacheOptions
from pipeserve.engine.base import GenerationJob, ModelRuntime
from pipeserve.engine.runtime import build_runtime
from tests.engine.helpers import collect, entry, job

pytestmark = pytest.mark.mlx

PROMPT = (
    "<|im_start|>user\nTell me a long story about a robot who learns to paint.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def runtime(demo_model_dir: Callable[[str], Any]) -> Iterator[ModelRuntime]:
    """No prefix cache: whatever is shared, the prompt group shares it."""
    demo_model_dir("qwen3")
    model = entry("demo:qwen3", prefix_cache=PrefixCacheOptions(enabled=False))
    built = build_runtime(model)
    yield built
    built.engine.close()


def grouped(prompt: list[int], seeds: list[int], group: str) -> list[GenerationJob]:
    return [
        dataclasses.replace(
            job(prompt, 20, temperature=1.0, seed=seed), prompt_group=group, group_size=len(seeds)
        )
        for seed in seeds
    ]


def test_n_choices_prefill_once_and_equal_their_single_answers(runtime: ModelRuntime) -> None:
    engine = runtime.engine
    prompt = list(runtime.tokenizer.encode(PROMPT, add_special_tokens=False))
    seeds = [7, 8, 9, 10]
    alone = [collect(engine.submit(job(prompt, 20, temperature=1.0, seed=s))).ids for s in seeds]
    before = engine.stats()
    streams = [engine.submit(j) for j in grouped(prompt, seeds, "req-a")]
    together = [collect(s) for s in streams]
    after = engine.stats()
    assert [c.ids for c in together] == alone and len(set(map(tuple, alone))) == 4
    prefilled = after["prefill_tokens_total"] - before["prefill_tokens_total"]
    assert prefilled == len(prompt) + 3  # once, then the last prompt token per other choice
    assert after["shared_prompt_rows_total"] - before["shared_prompt_rows_total"] == 3
    assert all(c.usage.prompt_tokens == len(prompt) for c in together)


def test_a_cancelled_choice_and_a_cancelled_leader(runtime: ModelRuntime) -> None:
    engine = runtime.engine
    prompt = list(runtime.tokenizer.encode(PROMPT * 3, add_special_tokens=False))
    jobs = grouped(prompt, [1, 2, 3], "req-b")
    alone = collect(engine.submit(job(prompt, 20, temperature=1.0, seed=3))).ids
    streams = [engine.submit(j) for j in jobs]
    streams[0].cancel()  # the leader, likely before its prompt is shared
    streams[1].cancel()
    results = [collect(s) for s in streams]
    assert results[0].finish.reason == "cancelled" and results[1].finish.reason == "cancelled"
    assert results[2].ids == alone and results[2].finish.reason == "length"
    after = [collect(engine.submit(j)).ids for j in grouped(prompt, [3], "req-c")]
    assert after == [alone]  # a group of one is an ordinary job
