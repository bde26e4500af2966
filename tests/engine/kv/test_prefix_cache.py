"""Prefix KV cache: longest-prefix reuse, memory-bounded LRU, real cached counts."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest

from pipeserve.engine.runtime import build_runtime
from tests.engine.helpers import collect, entry, job


@pytest.fixture()
def engine_with(demo_model_dir):
    built = []

    def make(family: str = "qwen3", **prefix_cache):
        demo_model_dir(family)
        runtime = build_runtime(entry(f"demo:{family}", prefix_cache=prefix_cache))
        built.append(runtime)
        return runtime

    yield make
    for runtime in built:
        runtime.engine.close()


def prompt(runtime, topic: str) -> list[int]:
    return list(runtime.tokenizer.encode(f"{topic} " * 150, add_special_tokens=False))


def cached(runtime, ids: list[int]) -> int:
    got = collect(runtime.engine.submit(job(ids, max_tokens=4)))
    assert got.ready.cached_tokens == got.usage.cached_tokens
    return got.usage.cached_tokens


def test_lru_is_bounded_by_bytes(engine_with):
    probe = engine_with()
    first = prompt(probe, "apple")
    cached(probe, first)
    entry_bytes = probe.engine.stats()["prefix_cache_bytes"]
    runtime = engine_with(max_bytes=int(entry_bytes * 1.5))  # room for one entry
    a, b = first, prompt(runtime, "banana")
    assert cached(runtime, a) == 0
    assert cached(runtime, b) == 0  # evicts a
    assert cached(runtime, a) == 0
    assert cached(runtime, a) == len(a) - 1
    assert runtime.engine.stats()["prefix_cache_bytes"] <= int(entry_bytes * 1.5)


def test_disabled_and_short_prompts_are_not_cached(engine_with):
    off = engine_with(enabled=False)
    ids = prompt(off, "cherry")
    cached(off, ids)
    assert cached(off, ids) == 0 and off.engine.stats()["prefix_cache_bytes"] == 0
    short = engine_with(min_tokens=1000)
    cached(short, ids)
    assert cached(short, ids) == 0


def test_cancelled_generation_is_cached(engine_with):
    runtime = engine_with()
    ids = prompt(runtime, "durian")
    stream = runtime.engine.submit(job(ids, max_tokens=5000))
    events = []
    for event in stream:
        events.append(event)
        if len(events) == 6:
            stream.cancel()
            break
    got = collect(events + list(stream))
    assert got.finish.reason == "cancelled"
    follow_up = (
        ids + got.ids + list(runtime.tokenizer.encode(" and more", add_special_tokens=False))
    )
    assert cached(runtime, follow_up) >= len(ids) + len(got.ids) - 1


def test_sliding_window_model_reuses_prompt_snapshot(engine_with):
    """gpt-oss caches (RotatingKVCache) cannot be trimmed once wrapped; the prompt
    snapshot taken after prefill still serves a repeated or extended prompt."""
    runtime = engine_with("gpt-oss")
    ids = prompt(runtime, "fig")
    first = collect(runtime.engine.submit(job(ids, max_tokens=6)))
    second = collect(runtime.engine.submit(job(ids, max_tokens=6)))
    assert second.usage.cached_tokens == len(ids) - 1 and second.ids == first.ids
    longer = ids + list(runtime.tokenizer.encode(" grape", add_special_tokens=False))
    assert cached(runtime, longer) == len(ids) - 1


def test_cached_prefixes_batched_together_give_the_same_tokens(engine_with):
    runtime = engine_with()
    prompts = [
        prompt(runtime, word)[: 60 + 25 * i] for i, word in enumerate(("kiwi", "lemon", "mango"))
    ]
    alone = [collect(runtime.engine.submit(job(p, max_tokens=10))) for p in prompts]
    assert all(got.usage.cached_tokens == 0 for got in alone)
    streams = [runtime.engine.submit(job(p, max_tokens=10)) for p in prompts]
    together = [collect(s) for s in streams]
    assert [got.usage.cached_tokens for got in together] == [len(p) - 1 for p in prompts]
    assert [got.ids for got in together] == [got.ids for got in alone]


def test_cached_entries_hold_only_their_own_memory(engine_with):
    """A batch row's KV extract is a slice of the whole batch's buffers: stored lazily,
    it pinned every row's full allocation (here 1.6x its own bytes), unseen by max_bytes."""
    runtime = engine_with()

    def batch_of_four(topics: tuple[str, ...]) -> tuple[int, int]:
        """(MLX's active bytes, the prefix cache's bytes) after four prompts run as one
        batch and a short uncached request after them (the stream ran every copy)."""
        streams = [runtime.engine.submit(job(prompt(runtime, t), max_tokens=4)) for t in topics]
        for stream in streams:
            collect(stream)
        collect(runtime.engine.submit(job(prompt(runtime, topics[0])[:3], max_tokens=1)))
        gc.collect()  # finished batches can sit in reference cycles
        return mx.get_active_memory(), runtime.engine.stats()["prefix_cache_bytes"]

    active, cached = batch_of_four(("fig", "grape", "kiwi", "lemon"))  # first-use state settles
    more_active, more_cached = batch_of_four(("mango", "olive", "peach", "plum"))
    assert more_cached > cached
    assert more_active - active <= (more_cached - cached) * 1.25
