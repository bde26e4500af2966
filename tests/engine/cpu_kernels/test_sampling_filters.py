"""Top-p (nucleus) and top-k filtering on the CPU (cpu_kernels/sampling_filters.cpp, used by
engine/sampling/samplers.py). Top-p:
the kept entries are checked against a float64 numpy reference of mlx-lm's rule (an entry
is kept when the mass above it, in descending order, is below p times the total; ties
with the smallest kept entry are kept too), over vocabulary sizes, temperatures of the
logits, p values, several rows and strided rows; masked (-inf) and NaN entries; and a
seeded sampler with top_p that draws only from the nucleus, in its proportions. Top-k:
exactly k kept, none smaller than a dropped one, ties with the k-th by position, the
same entries as mlx-lm's apply_top_k where nothing ties. The draw (categorical): the
softmax's frequencies over 6 and 5000 entries (across its blocks of partial sums), never
a -inf entry, the uniform's ends, rows without a finite weight, a seeded sampler's
repeatability and its temperature."""

from __future__ import annotations

from collections import Counter
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from pipeserve.engine.sampling.samplers import make_sampler
from pipeserve.request import SamplingParams

pytestmark = pytest.mark.mlx

# Masses are float64 sums of float32 exps (within ~1 ulp each): the boundary may move by
# rounding only, far less than one entry's mass at these sizes.
MASS_TOLERANCE = 1e-9


def logprobs(rows: int, vocab: int, scale: float, seed: int) -> mx.array:
    logits = mx.random.normal((rows, vocab), key=mx.random.key(seed)) * scale
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def check_nucleus(row: np.ndarray, filtered: np.ndarray, top_p: float) -> None:
    kept = np.isfinite(filtered)
    assert np.array_equal(filtered[kept], row[kept])  # kept entries unchanged
    order = np.argsort(-row.astype(np.float64), kind="stable")
    probs = np.exp(row[order].astype(np.float64))
    above = np.cumsum(probs) - probs  # mass of the entries before each in descending order
    target = top_p * probs.sum()
    in_nucleus = above < target - MASS_TOLERANCE
    outside = above >= target + MASS_TOLERANCE
    kept_sorted = kept[order]
    assert kept_sorted[in_nucleus].all()
    threshold = row[kept].min()
    # Outside the nucleus only ties with the smallest kept entry stay.
    assert (row[order][outside & kept_sorted] == threshold).all()
    assert not (row < threshold)[kept].any()


@pytest.mark.parametrize("vocab", [7, 1000, 49152, 151936])
@pytest.mark.parametrize("scale", [0.3, 3.0, 30.0])
def test_the_nucleus_matches_a_float64_reference(ext: Any, vocab: int, scale: float) -> None:
    for seed, top_p in enumerate([0.05, 0.5, 0.9, 0.95, 0.999]):
        lp = logprobs(3, vocab, scale, seed)
        filtered = np.array(ext.top_p(lp, top_p))
        for row, out in zip(np.array(lp), filtered):
            check_nucleus(row, out, top_p)


def test_strided_rows_and_leading_axes(ext: Any) -> None:
    lp = logprobs(6, 5000, 3.0, 1)
    strided = lp.T.reshape(5000, 6).T  # a transposed copy's view: not row-contiguous
    expected = np.array(ext.top_p(mx.array(np.array(lp)), 0.9))
    assert np.array_equal(np.array(ext.top_p(strided, 0.9)), expected)
    batched = ext.top_p(lp.reshape(2, 3, 5000), 0.9)
    assert batched.shape == (2, 3, 5000)
    assert np.array_equal(np.array(batched).reshape(6, 5000), expected)


def test_where_mass_is_concentrated_it_equals_mlx_lm(ext: Any) -> None:
    """mlx-lm sums in float32, so large flat rows move its boundary by a few tail entries;
    where the mass sits on few entries both keep the same ones."""
    for seed, top_p in enumerate([0.3, 0.8, 0.95]):
        lp = logprobs(4, 49152, 12.0, seed)
        assert np.array_equal(np.array(ext.top_p(lp, top_p)), np.array(apply_top_p(lp, top_p)))


def test_masked_and_non_finite_entries(ext: Any) -> None:
    inf = float("inf")
    masked = mx.array([[-inf, np.log(0.6), -inf, np.log(0.3), np.log(0.1)]], dtype=mx.float32)
    out = np.array(ext.top_p(masked, 0.7))
    assert np.isfinite(out).tolist() == [[False, True, False, True, False]]
    only = mx.array([[-inf, 0.0, -inf]], dtype=mx.float32)
    assert np.array_equal(np.array(ext.top_p(only, 0.5)), np.array(only))
    nothing = mx.full((1, 4), -inf)
    assert np.array_equal(np.array(ext.top_p(nothing, 0.5)), np.array(nothing))
    nan_row = mx.array([[0.0, float("nan"), -1.0]], dtype=mx.float32)
    assert np.array_equal(np.array(ext.top_p(nan_row, 0.5)), np.array(nan_row), equal_nan=True)
    with pytest.raises(ValueError):
        ext.top_p(masked, 0.0)
    with pytest.raises(ValueError):
        ext.top_p(masked.astype(mx.float16), 0.5)


def test_a_seeded_top_p_sampler_draws_only_from_the_nucleus(ext: Any) -> None:
    probs = np.array([0.5, 0.3, 0.1, 0.05, 0.03, 0.02])
    row = mx.array(np.log(probs)[None, :], dtype=mx.float32)
    # Mass above each: 0, .5, .8, .9, ...: with p = 0.85 the first three stay.
    sampler = make_sampler(SamplingParams(temperature=1.0, top_p=0.85, seed=3))
    counts = Counter(int(sampler(row).item()) for _ in range(3000))
    assert set(counts) == {0, 1, 2}
    for token, share in enumerate(probs[:3] / probs[:3].sum()):
        assert abs(counts[token] / 3000 - share) < 0.04, (token, counts)


@pytest.mark.parametrize("vocab", [50, 49152, 151936])
@pytest.mark.parametrize("scale", [0.3, 3.0, 30.0])
def test_top_k_keeps_the_k_largest(ext: Any, vocab: int, scale: float) -> None:
    for seed, k in enumerate([1, 5, 20, 40]):
        lp = logprobs(3, vocab, scale, seed)
        filtered = np.array(ext.top_k(lp, k))
        for row, out in zip(np.array(lp), filtered):
            kept = np.isfinite(out)
            assert kept.sum() == k and np.array_equal(out[kept], row[kept])
            assert row[kept].min() >= row[~kept].max()
        if len({float(v) for v in np.array(lp).ravel()}) == lp.size:  # no ties
            assert np.array_equal(filtered, np.array(apply_top_k(lp, k)))


def test_top_k_ties_masks_and_bounds(ext: Any) -> None:
    inf = float("inf")
    ties = mx.array([[1.0, 2.0, 2.0, 2.0, 0.0]])
    assert np.isfinite(np.array(ext.top_k(ties, 2))).tolist() == [[False, True, True, False, False]]
    masked = mx.array([[-inf, 0.5, -inf, -inf]])  # fewer finite entries than k
    assert np.array_equal(np.array(ext.top_k(masked, 2)), np.array(masked))
    nan_row = mx.array([[0.0, float("nan"), -1.0]])
    assert np.array_equal(np.array(ext.top_k(nan_row, 1)), np.array(nan_row), equal_nan=True)
    for k in (0, 5):
        with pytest.raises(ValueError):
            ext.top_k(ties, k)


def test_a_seeded_top_k_sampler_draws_only_the_k_best(ext: Any) -> None:
    probs = np.array([0.1, 0.4, 0.05, 0.3, 0.15])
    row = mx.array(np.log(probs)[None, :], dtype=mx.float32)
    sampler = make_sampler(SamplingParams(temperature=1.0, top_k=2, seed=4), vocab_size=5)
    counts = Counter(int(sampler(row).item()) for _ in range(2000))
    assert set(counts) == {1, 3}
    assert abs(counts[1] / 2000 - 4 / 7) < 0.05, counts


def draws(ext: Any, logits: np.ndarray, count: int, seed: int) -> np.ndarray:
    rows = mx.broadcast_to(mx.array(logits[None, :]), (count, logits.shape[0]))
    uniforms = mx.random.uniform(shape=(count, 2), key=mx.random.key(seed))
    return np.array(ext.categorical(rows, uniforms))


def test_categorical_draws_the_softmax(ext: Any) -> None:
    probs = np.array([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0])
    logits = np.where(probs > 0, np.log(np.where(probs > 0, probs, 1.0)), -np.inf)
    drawn = draws(ext, logits.astype(np.float32), 40000, 0)
    assert drawn.max() < 5  # never the -inf entry
    assert np.abs(np.bincount(drawn, minlength=6) / 40000 - probs).max() < 0.01
    # 5000 entries: the partial sums per block of entries find the right block.
    logits = np.random.default_rng(0).normal(size=5000).astype(np.float32) * 2
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    frequencies = np.bincount(draws(ext, logits, 100000, 1), minlength=5000) / 100000
    top = np.argsort(-probs)[:20]
    assert np.abs(frequencies[top] - probs[top]).max() < 0.003


def test_categorical_at_the_uniforms_ends_and_on_rows_without_weight(ext: Any) -> None:
    inf = float("inf")
    row = mx.array([[-inf, 1.0, -inf, 2.0, -inf]], dtype=mx.float32)
    low = mx.array([[0.0, 0.0]], dtype=mx.float32)
    high = mx.array([[1.0 - 2**-23, 1.0 - 2**-23]], dtype=mx.float32)
    assert ext.categorical(row, low).item() == 1  # the first entry with weight
    assert ext.categorical(row, high).item() == 3  # the last
    assert ext.categorical(mx.full((1, 4), -inf), low).item() == 0
    nan_row = mx.array([[0.0, float("nan"), 3.0, 3.0]], dtype=mx.float32)
    assert ext.categorical(nan_row, high).item() == 2  # the first largest, as argmax
    columns = mx.array([[-inf, -inf], [0.0, 0.0], [-inf, -inf]])
    strided = columns.T  # (2, 3) rows read with a stride: [-inf, 0, -inf] each
    assert np.array(ext.categorical(strided, mx.zeros((2, 2)))).tolist() == [1, 1]
    with pytest.raises(ValueError):
        ext.categorical(row, mx.zeros((1, 3)))


def test_a_seeded_sampler_repeats_and_follows_its_temperature(ext: Any) -> None:
    row = mx.array(np.log([[0.6, 0.3, 0.1]]), dtype=mx.float32)

    def run(temperature: float, seed: int) -> list[int]:
        sampler = make_sampler(SamplingParams(temperature=temperature, seed=seed))
        return [int(sampler(row).item()) for _ in range(2000)]

    assert run(1.0, 7) == run(1.0, 7)
    assert run(1.0, 7) != run(1.0, 8)
    sharp = Counter(run(0.5, 9))  # p^2 renormalised: 0.78, 0.196, 0.022
    assert abs(sharp[0] / 2000 - 0.36 / 0.46) < 0.04, sharp
