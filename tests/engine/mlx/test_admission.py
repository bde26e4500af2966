"""Admission of a burst: prompts are prefilled by a token budget, not in rounds of a count.

The Scheduler is driven step by step on the test thread (it belongs to the thread that runs
it), on the qwen3 demo model loaded by mlx-lm.
"""

from __future__ import annotations

import pytest

from pipeserve.config.models import EngineOptions
from pipeserve.engine.mlx.scheduler import Scheduler
from pipeserve.engine.output.channel import Channel, Courier
from pipeserve.engine.output.detokenize import Detokenizers
from pipeserve.engine.output.request_state import RequestState
from pipeserve.engine.runtime import build_runtime
from tests.engine.helpers import collect, entry, job, reference_ids

pytestmark = pytest.mark.mlx

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "sailors",
    "sing",
]


def prompts(tokenizer, count: int, words: int) -> list[list[int]]:
    return [
        list(tokenizer.encode(" ".join(WORDS[(i + k) % len(WORDS)] for k in range(words))))
        for i in range(count)
    ]


def first_token_steps(model, tokenizer, burst: list[list[int]], **options) -> list[int]:
    """The step at which each request of a burst got its first token."""
    batch = Scheduler(model, EngineOptions(max_batch=len(burst), **options), {})
    courier, detokenizers = Courier(), Detokenizers(tokenizer)
    seqs = [
        RequestState(job(p, max_tokens=4), Channel(), detokenizers.new(), tokenizer) for p in burst
    ]
    for key, seq in enumerate(seqs):
        batch.add(key, seq, courier)
    first: dict[int, int] = {}
    for step in range(1, 40):
        batch.step(courier)
        first.update(
            {k: step for k, s in enumerate(seqs) if s.completion_tokens and k not in first}
        )
        if len(first) == len(seqs):
            return [first[k] for k in range(len(seqs))]
    raise AssertionError(f"not every request started: {first}")


def test_a_burst_of_short_prompts_starts_together(demo_model) -> None:
    model, tokenizer = demo_model("qwen3")
    burst = prompts(tokenizer, 12, 6)
    steps = first_token_steps(model, tokenizer, burst)
    assert len(set(steps)) == 1, steps  # one prefill round, first tokens in one step


def test_the_token_budget_bounds_each_round(demo_model) -> None:
    model, tokenizer = demo_model("qwen3")
    burst = prompts(tokenizer, 9, 6)
    budget = 3 * (max(len(p) for p in burst) - 1)  # three prompts per round (last tokens decode)
    steps = first_token_steps(model, tokenizer, burst, prefill_tokens=budget)
    counts = [steps.count(s) for s in sorted(set(steps))]
    assert counts == [3, 3, 3], steps
    assert steps == sorted(steps)  # first come, first prefilled


def test_mixed_burst_under_a_small_budget_equals_mlx_lm(demo_model_dir, demo_model) -> None:
    """Rounds of varying size, prompts longer than the budget and chunked prefill mixed:
    every request's greedy tokens still equal mlx-lm's one-by-one."""
    demo_model_dir("qwen3")
    model, tokenizer = demo_model("qwen3")
    runtime = build_runtime(
        entry("demo:qwen3", max_batch=10, prefill_tokens=40, prefill_step_size=16)
    )
    try:
        burst = [
            p for words in (2, 25, 4, 9, 40, 3, 14, 6, 30, 5) for p in prompts(tokenizer, 1, words)
        ]
        streams = [runtime.engine.submit(job(p, max_tokens=6)) for p in burst]
        for prompt, stream in zip(burst, streams):
            assert collect(stream).ids == reference_ids(model, tokenizer, prompt, 6)
    finally:
        runtime.engine.close()
