"""Rows finishing at different steps (engine/kv/rows.py): the kept rows' caches and a
finished row's extract equal mlx-lm's BatchKVCache.filter / extract (the kept rows moved
in place where nothing else holds a buffer, a held one left alone), the tokens equal
mlx-lm's path, and the decoder layer op writes into the compacted buffers instead of
copying them again."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache

from pipeserve.engine.kv.rows import keep_rows, kernel_finalize, row_cache, trim_rows
from pipeserve.engine.mlx.generator import BatchGenerator, DecodeBatch, MlxGenerationBatch
from pipeserve.engine.mlx.step_plan import StepPlan
from tests.engine.cpu_kernels.test_fused_layers import tiny_llama, twins

pytestmark = pytest.mark.mlx

PADDING = [3, 0, 1, 2]  # row 1 has none: without it, every kept row drops one position


def written(cache: BatchKVCache, lengths: tuple[int, ...], key: mx.array) -> mx.array:
    """`cache` given random keys and values, `lengths` positions at a time (2 heads of
    16); the next random key."""
    for length in lengths:
        key, k1, k2 = mx.random.split(key, 3)
        shape = (cache.left_padding.size, 2, length, 16)
        cache.update_and_fetch(mx.random.normal(shape, key=k1), mx.random.normal(shape, key=k2))
    return key


def assert_same_rows(ours: list[BatchKVCache], theirs: list[BatchKVCache]) -> None:
    """Every row's used positions (from its left padding to the index) equal."""
    for mine, reference in zip(ours, theirs):
        for row, padding in enumerate(reference.left_padding.tolist()):
            used = slice(padding, reference._idx)
            assert mx.array_equal(mine.keys[row, :, used], reference.keys[row, :, used])
            assert mx.array_equal(mine.values[row, :, used], reference.values[row, :, used])


def padded_caches(layers: int = 2) -> list[BatchKVCache]:
    """Left-padded BatchKVCaches after a 6-position prefill and two decode steps."""
    key = mx.random.key(5)
    caches = []
    for _ in range(layers):
        cache = BatchKVCache(PADDING)
        key = written(cache, (6, 1, 1), key)
        caches.append(cache)
    mx.eval([c.state for c in caches])
    return caches


def copied(caches: list[BatchKVCache]) -> list[BatchKVCache]:
    out = []
    for cache in caches:
        twin = BatchKVCache([0] * len(PADDING))
        twin.state = tuple(mx.array(a) if isinstance(a, mx.array) else a for a in cache.state)
        out.append(twin)
    return out


def address(a: mx.array) -> int:
    """Where `a`'s data starts (the numpy view is dropped at once: it would hold `a`)."""
    return int(np.asarray(a).__array_interface__["data"][0])


@pytest.mark.parametrize("kernels", [True, False])
def test_kept_rows_and_extracts_equal_mlx_lm(ext, kernels):
    ops = ext if kernels else None
    theirs = padded_caches()
    ours = copied(theirs)
    for index in range(len(PADDING)):
        got_rows, made = row_cache(ours, index, ops)
        assert len(made) == (2 * len(ours) if kernels else 0)
        for want, got in zip([c.extract(index) for c in theirs], got_rows):
            assert got.offset == want.offset
            assert np.array_equal(np.array(got.keys), np.array(want.keys))
            assert np.array_equal(np.array(got.values), np.array(want.values))
    keep = [0, 2, 3]
    for cache in theirs:
        cache.filter(keep)
    held = ours[0].keys  # still held (a prefix-cache entry would): copied, not moved
    snapshot = np.array(held)
    places = [address(c.values) for c in ours]
    made = keep_rows(ours, keep, ops)
    assert len(made) == (2 * len(ours) if kernels else 0)
    for want, got in zip(theirs, ours):
        assert got._idx == want._idx == 7  # 8 positions, the common padding (1) dropped
        assert got.left_padding.tolist() == want.left_padding.tolist() == [2, 0, 1]
        assert got.offset.tolist() == want.offset.tolist()
        assert got.keys.shape[:2] == want.keys.shape[:2] and got.keys.shape[2] >= got._idx
        for a, b in ((got.keys, want.keys), (got.values, want.values)):
            assert np.array_equal(np.array(a)[:, :, : got._idx], np.array(b)[:, :, : got._idx])
    assert np.array_equal(np.array(held), snapshot)
    if kernels:
        # Nothing else held the values: moved in place, no new buffer. The held keys got
        # a new buffer, zeros after the used positions (a later roll may show them).
        assert [address(c.values) for c in ours] == places
        assert not np.array(ours[0].keys)[:, :, ours[0]._idx :].any()


def test_a_buffer_keeping_few_rows_is_replaced(ext):
    """Kept in place, a buffer would hold every finished row's memory: under half its
    rows kept, the rows go to a new, smaller buffer (zeros after them)."""
    ours = copied(padded_caches(layers=1))
    place = address(ours[0].values)
    keep_rows(ours, [0, 2, 3], ext)  # 3 of 4 rows: in place
    assert address(ours[0].values) == place
    keep_rows(ours, [1, 2], ext)  # 2 of 3, but of the 4 rows' allocation: in place
    assert address(ours[0].values) == place
    keep_rows(ours, [1], ext)  # 1 of the 4 rows' allocation: a new buffer
    values = np.array(ours[0].values)
    assert address(ours[0].values) != place
    assert values.shape[0] == 1 and not values[:, :, ours[0]._idx :].any()


def staggered_run(model: Any, ext: Any, prompts: list[list[int]], lengths: list[int]) -> dict:
    """Greedy tokens of each prompt, decoded together; rows end at different steps."""
    gen = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8, cache_ops=ext)
    plan = StepPlan(prefill_rows=8, logprobs=False)
    uids = gen.insert(prompts, max_tokens=lengths)
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    done = 0
    while done < len(uids):
        for response in gen.step(plan)[1]:
            tokens[response.uid].append(response.token)
            done += response.finish_reason is not None
    gen.close()
    return {uid: tokens[uid] for uid in uids}


def test_finishing_rows_cost_no_second_copy_and_keep_the_tokens(ext, monkeypatch):
    """The row without left padding ends first, so the others drop a common padding.
    mlx-lm's filter leaves the layer op a strided view of its gather, which the op copies
    whole; ours hands it compact buffers it writes into. Same tokens either way."""
    _, model = twins(tiny_llama, ext, True)
    prompts = [[5, 17, 3, 88, 41, 9, 60, 2, 33], [7, 8, 9, 10, 11], [1, 2, 3, 4, 5, 6, 7],
               [40, 41, 42, 43, 44, 45]]  # fmt: skip
    lengths = [3, 12, 8, 10]
    before = ext.cache_copy_bytes()
    ours = staggered_run(model, ext, prompts, lengths)
    assert ext.cache_copy_bytes() == before
    monkeypatch.setattr(DecodeBatch, "filter", MlxGenerationBatch.filter)
    monkeypatch.setattr(DecodeBatch, "extract_cache", MlxGenerationBatch.extract_cache)
    theirs = staggered_run(model, None, prompts, lengths)
    assert ext.cache_copy_bytes() > before  # mlx-lm's filter: the layer op copied
    assert list(ours.values()) == list(theirs.values())
    assert [len(t) for t in ours.values()] == lengths


@pytest.mark.parametrize("stale", [[2, 0, 3, 1], [1, 1, 1, 1], [0, 4, 0, 0]])
def test_verification_rollback_with_the_kernel_equals_mlx_lm_roll(ext, stale):
    """A verification's rollback (speculative.trim_rows): rows that keep more stale
    positions move right. The kernel op moves only their used positions, in place where
    nothing else holds a buffer; every row's positions equal mlx-lm's dynamic_roll's."""
    theirs = padded_caches()
    ours = copied(theirs)
    before = address(ours[0].keys)
    trim_rows(theirs, stale)
    trim_rows(ours, stale, ext)
    mx.eval([c.state for c in theirs + ours])
    for mine, reference in zip(ours, theirs):
        assert mine._idx == reference._idx
        assert mine.left_padding.tolist() == reference.left_padding.tolist()
        assert mine.offset.tolist() == reference.offset.tolist()
    assert_same_rows(ours, theirs)
    assert address(ours[0].keys) == before  # moved in place


def right_padded_prefill(lengths: list[int], layers: int = 2) -> list[BatchKVCache]:
    """BatchKVCaches after mlx-lm's prefill of prompts of `lengths` (right-padded to the
    longest, in two chunks), not yet finalized."""
    key = mx.random.key(7)
    longest = max(lengths)
    caches = []
    for _ in range(layers):
        cache = BatchKVCache([0] * len(lengths))
        cache.prepare(lengths=lengths, right_padding=[longest - n for n in lengths])
        key = written(cache, (longest - 2, 2), key)
        caches.append(cache)
    mx.eval([c.state for c in caches])
    return caches


class CountingRolls:
    """The kernels' extension, counting the buffers of each roll_rows call."""

    def __init__(self, ext: Any) -> None:
        self.ext, self.calls = ext, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ext, name)

    def roll_rows(self, *args: Any) -> Any:
        self.calls.append(len(args[0]))
        return self.ext.roll_rows(*args)


def test_a_right_padded_prefill_finalized_by_the_kernel_equals_mlx_lm(ext, monkeypatch):
    """kernel_finalize: one roll_rows op for every layer, at the first layer's finalize;
    offsets, left padding and every used position equal mlx-lm's dynamic_roll."""
    lengths = [5, 9, 7, 9]
    theirs = right_padded_prefill(lengths)
    ours = right_padded_prefill(lengths)
    counting = CountingRolls(ext)
    for cache in theirs:
        cache.finalize()
    with kernel_finalize(ours, counting):
        for cache in ours:
            cache.finalize()
    mx.eval([c.state for c in theirs + ours])
    assert counting.calls == [4]  # keys and values of both layers, in one op
    assert "finalize" not in vars(ours[0])  # the instance's own method is back
    for mine, reference in zip(ours, theirs):
        assert mine._right_padding is None and mine._idx == reference._idx == 9
        assert mine.left_padding.tolist() == reference.left_padding.tolist() == [4, 0, 2, 0]
        assert mine.offset.tolist() == reference.offset.tolist() == lengths
    assert_same_rows(ours, theirs)


def test_prompts_of_different_lengths_decode_the_same_with_the_kernel_roll(ext):
    """A batched prefill of prompts of different lengths (right-padded, then finalized)
    gives every row the same greedy tokens with the kernels' roll as with mlx-lm's."""
    model = tiny_llama()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15], [16]]
    lengths = [6, 6, 6, 6]
    assert staggered_run(model, ext, prompts, lengths) == staggered_run(
        model, None, prompts, lengths
    )
