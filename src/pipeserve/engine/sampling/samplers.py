"""Per-request samplers and logits processors for mlx-lm's BatchGenerator.

BatchGenerator accepts one sampler per sequence but has no per-request seed (mlx-lm's
samplers draw from the global random state). A seeded request gets its own PRNG key,
split once per decode step, so the same seed gives the same tokens whether the
request runs alone or batched with others. Greedy requests share mlx-lm's
`greedy_sampler` object and unseeded ones with equal parameters share one sampler,
which lets BatchGenerator sample each group in one batched call.

Top-p and top-k on the CPU run as the CPU kernels' ops (cpu_kernels/sampling_filters.cpp):
mlx-lm's `apply_top_p` sorts the whole vocabulary for every sampled token (3.6 ms at
SmolLM2's 49152 entries, 12 ms at Qwen's 151936, on this project's 2-core machines) and
`apply_top_k` partitions it; the ops sort only the entries near the edge (top-p 0.24 /
0.63 ms). Same rules (top-p's masses summed in float64); elsewhere (a GPU, no
kernels) mlx-lm's own run. The draw likewise: one uniform per row inverting the
cumulative distribution, where MLX's categorical draws a Gumbel variate per entry (0.6 /
1.75 ms).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
)

from pipeserve.engine import cpu_kernels
from pipeserve.request import SamplingParams

Sampler = Callable[[mx.array], mx.array]
Filter = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

REPETITION_CONTEXT = 64
# OpenAI's presence/frequency penalties count tokens "so far"; the window bounds the
# per-step cost (mlx-lm counts within the last N tokens of the sequence).
PENALTY_CONTEXT = 256


def check(params: SamplingParams) -> None:
    """Reject values mlx-lm's samplers would raise on while being compiled: an exception
    inside mx.compile leaves tracers in the global random state and breaks later steps."""
    if not (params.temperature >= 0 and 0 <= params.top_p <= 1 and 0 <= params.min_p <= 1
            and params.top_k >= 0 and params.repetition_penalty > 0
            and -2 <= params.presence_penalty <= 2 and -2 <= params.frequency_penalty <= 2
            and all(-100 <= bias <= 100 for bias in params.logit_bias.values())):  # fmt: skip
        raise ValueError(f"invalid sampling parameters: {params}")


def make_sampler(params: SamplingParams, vocab_size: int | None = None) -> Sampler:
    check(params)
    if params.temperature <= 0 or params.top_p <= 0:
        return greedy_sampler
    if params.seed is None and (params.top_k == 0 or vocab_size is not None):
        top_k = params.top_k if vocab_size is None or params.top_k < vocab_size else 0
        return _shared_sampler(params.temperature, params.top_p, params.min_p, top_k)
    seed = params.seed if params.seed is not None else random.getrandbits(63)
    return _seeded_sampler(params, seed)


@functools.lru_cache(maxsize=256)
def _shared_sampler(temperature: float, top_p: float, min_p: float, top_k: int) -> Sampler:
    """Unseeded requests with equal parameters share one sampler object, so
    BatchGenerator samples them in one batched call (global random state)."""
    return _chain(temperature, top_p, min_p, top_k, lambda: None)


def _seeded_sampler(params: SamplingParams, seed: int) -> Sampler:
    state = {"key": mx.random.key(seed)}

    def step_key() -> mx.array:
        state["key"], key = mx.random.split(state["key"])
        return key

    return _chain(params.temperature, params.top_p, params.min_p, params.top_k, step_key)


def _chain(
    temperature: float,
    top_p: float,
    min_p: float,
    top_k: int,
    step_key: Callable[[], mx.array | None],
) -> Sampler:
    """mlx-lm's make_sampler: its filters in its order (top-p, min-p, top-k), then a draw
    at the temperature, with the key step_key gives (None: the global random state)."""
    ext = _cpu_ops()
    filters: list[Filter] = []
    if 0 < top_p < 1.0:
        filters.append(_top_p_filter(ext, top_p))
    if min_p > 0.0:
        filters.append(lambda x: apply_min_p(x, min_p))
    if top_k > 0:  # a top_k as large as the vocabulary keeps everything
        filters.append(_top_k_filter(ext, top_k))
    inverse_temperature = 1.0 / temperature

    def sampler(logprobs: mx.array) -> mx.array:
        key = step_key()
        for apply in filters:
            logprobs = apply(logprobs)
        return _draw(ext, logprobs * inverse_temperature, key)

    return sampler


def _cpu_ops() -> Any:
    """The CPU kernels where the arrays live on the CPU, else None."""
    return cpu_kernels.kernels() if mx.default_device() == mx.cpu else None


def _draw(ext: Any, logits: mx.array, key: mx.array | None) -> mx.array:
    """One token per row from softmax(logits) (what mx.random.categorical draws), with
    the key's (or the global random state's) uniforms; `ext`: _cpu_ops()."""
    if ext is None or logits.dtype != mx.float32:
        return mx.random.categorical(logits, key=key)
    uniforms = mx.random.uniform(shape=(*logits.shape[:-1], 2), key=key)
    return ext.categorical(logits, uniforms)


def _top_p_filter(ext: Any, top_p: float) -> Filter:
    if ext is None:
        return lambda x: apply_top_p(x, top_p)
    return lambda x: ext.top_p(x, top_p) if x.dtype == mx.float32 else apply_top_p(x, top_p)


def _top_k_filter(ext: Any, top_k: int) -> Filter:
    def apply(x: mx.array) -> mx.array:
        if top_k >= x.shape[-1]:
            return x
        if ext is not None and x.dtype == mx.float32:
            return ext.top_k(x, top_k)
        return apply_top_k(x, top_k)

    return apply


def make_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """Bias and penalty processors; none (the fast batched path) when all are neutral."""
    return make_logits_processors(
        logit_bias=params.logit_bias or None,
        repetition_penalty=None
        if params.repetition_penalty in (0.0, 1.0)
        else params.repetition_penalty,
        repetition_context_size=REPETITION_CONTEXT,
        presence_penalty=params.presence_penalty or None,
        presence_context_size=PENALTY_CONTEXT,
        frequency_penalty=params.frequency_penalty or None,
        frequency_context_size=PENALTY_CONTEXT,
    )
