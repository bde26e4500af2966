"""Sampling parameters take effect per request, also when mixed in one batch."""

from __future__ import annotations

import pytest
from mlx_lm.sample_utils import greedy_sampler

from pipeserve.engine.sampling.samplers import make_processors, make_sampler
from pipeserve.request import SamplingParams
from tests.engine.helpers import collect, job

PROMPT = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"


def test_sampler_sharing():
    assert make_sampler(SamplingParams(temperature=0.0)) is greedy_sampler
    unseeded = make_sampler(SamplingParams(temperature=0.7))
    assert make_sampler(SamplingParams(temperature=0.7)) is unseeded  # batched together
    assert make_sampler(SamplingParams(temperature=0.7, seed=1)) is not make_sampler(
        SamplingParams(temperature=0.7, seed=1)
    )
    assert make_processors(SamplingParams()) == []
    assert len(make_processors(SamplingParams(repetition_penalty=1.3))) == 1
    assert len(make_processors(SamplingParams(presence_penalty=0.5, frequency_penalty=-1.0))) == 2
    assert make_processors(SamplingParams()) == []


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 1.5, "top_k": 1},
        {"temperature": 1.5, "top_k": 1, "seed": 5},
        {"temperature": 1.5, "min_p": 1.0, "seed": 9},
        {"temperature": 1.5, "top_p": 1e-6},
    ],
)
def test_filters_that_keep_only_the_best_token_equal_greedy(mlx_runtime, sampling):
    runtime = mlx_runtime("qwen3")
    prompt = list(runtime.tokenizer.encode(PROMPT, add_special_tokens=False))
    greedy = collect(runtime.engine.submit(job(prompt, 12))).ids
    # Run next to a greedy and an unconstrained request: per-request parameters hold.
    streams = [
        runtime.engine.submit(job(prompt, 12, **s)) for s in (sampling, {"temperature": 1.5}, {})
    ]
    constrained, _, plain = (collect(s).ids for s in streams)
    assert constrained == greedy == plain


def test_repetition_penalty_changes_output(mlx_runtime):
    runtime = mlx_runtime("qwen3")
    prompt = list(runtime.tokenizer.encode(PROMPT, add_special_tokens=False))
    plain = collect(runtime.engine.submit(job(prompt, 40))).ids
    penalized = collect(runtime.engine.submit(job(prompt, 40, repetition_penalty=5.0))).ids
    assert penalized != plain
    assert len(set(penalized)) >= len(set(plain))


@pytest.mark.parametrize("penalty", ["presence_penalty", "frequency_penalty"])
def test_openai_penalties_change_output_of_that_request_only(mlx_runtime, penalty):
    runtime = mlx_runtime("qwen3")
    prompt = list(runtime.tokenizer.encode(PROMPT, add_special_tokens=False))
    plain = collect(runtime.engine.submit(job(prompt, 40))).ids
    # Batched with an unpenalized request, which must stay greedy.
    streams = [
        runtime.engine.submit(job(prompt, 40, **{penalty: 2.0})),
        runtime.engine.submit(job(prompt, 40)),
    ]
    penalized, neighbour = (collect(s).ids for s in streams)
    assert neighbour == plain
    assert penalized != plain
    assert len(set(penalized)) > len(set(plain))


def test_logit_bias_forces_and_bans_tokens(mlx_runtime):
    runtime = mlx_runtime("qwen3")
    prompt = list(runtime.tokenizer.encode(PROMPT, add_special_tokens=False))
    plain = collect(runtime.engine.submit(job(prompt, 8))).ids
    forced_id = 13  # "."
    streams = [
        runtime.engine.submit(job(prompt, 8, logit_bias={forced_id: 100.0})),
        runtime.engine.submit(job(prompt, 8, logit_bias={plain[0]: -100.0})),
        runtime.engine.submit(job(prompt, 8)),  # batched neighbour without a bias
    ]
    forced, banned, neighbour = (collect(s).ids for s in streams)
    assert forced == [forced_id] * 8
    assert banned[0] != plain[0]
    assert neighbour == plain


@pytest.mark.parametrize("seed", [None, 3])
def test_top_k_beyond_vocabulary_keeps_everything(mlx_runtime, seed):
    runtime = mlx_runtime("qwen3")
    prompt = list(runtime.tokenizer.encode(PROMPT, add_special_tokens=False))
    faults = runtime.engine.stats()["engine_faults"]
    got = collect(runtime.engine.submit(job(prompt, 6, temperature=1.0, top_k=10**7, seed=seed)))
    assert got.finish.reason == "length" and len(got.tokens) == 6
    assert runtime.engine.stats()["engine_faults"] == faults
