"""options.kv_cache: the batch's KV cache kept quantized (engine/kv/quantized.py).

The cache's operations keep exactly the rows a float BatchKVCache keeps (compared on
the dequantized values); generation through it equals mlx-lm's own single-sequence
QuantizedKVCache generation token for token, in a batch of mixed lengths, from a
prefix-cache hit (whose entry is quantized: its bytes show it), with speculation
verifying proposals (rejected positions trimmed / rolled) and for a prompt group's n
choices (the leader's quantized prompt KV copied). The demo models' heads are 16 wide,
below MLX's smallest group (32): the tests use the qwen3 demo with 32-wide heads.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache
from mlx_lm.utils import load_tokenizer

from pipeserve.config.models import EngineOptions, PrefixCacheOptions, SpeculativeOptions
from pipeserve.engine.base import GenerationJob, ModelRuntime
from pipeserve.engine.kv.quantized import BatchQuantizedKVCache, QuantizedRowCache
from pipeserve.engine.kv.rows import keep_rows, row_cache, trim_rows
from pipeserve.engine.mlx.scheduler import Scheduler
from pipeserve.engine.output.channel import Channel, Courier
from pipeserve.engine.output.detokenize import Detokenizers
from pipeserve.engine.output.request_state import RequestState
from pipeserve.engine.runtime import build_runtime
from pipeserve.engine.weights.demo.build import _write_weights
from pipeserve.engine.weights.loader import load_model
from pipeserve.events import TokenText
from pipeserve.request import SamplingParams
from tests.engine.helpers import FreeVerification, collect, entry, job

pytestmark = pytest.mark.mlx

GROUP = 32
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n" * 3


@pytest.fixture(scope="module")
def folder(demo_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The qwen3 demo model with 32-wide attention heads (new random weights)."""
    out = tmp_path_factory.mktemp("wide") / "qwen3-wide"
    shutil.copytree(demo_model_dir("qwen3"), out)
    config = json.loads((out / "config.json").read_text())
    config["head_dim"] = 32
    (out / "config.json").write_text(json.dumps(config))
    _write_weights(config, 7, out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def reference(folder: Path) -> tuple[Any, Any]:
    return tuple(mlx_lm.load(str(folder)))  # type: ignore[return-value]


def mlx_lm_ids(
    reference: tuple[Any, Any], prompt: list[int], n: int, bits: int | None
) -> list[int]:
    """Greedy tokens of mlx-lm's generate_step with its QuantizedKVCache from the start
    (bits None: its float KVCache)."""
    model = reference[0]
    cache = [
        KVCache() if bits is None else QuantizedKVCache(group_size=GROUP, bits=bits)
        for _ in model.layers
    ]
    steps = generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache)
    return [int(token) for token, _ in steps]


def runtime_of(folder: Path, bits: int, **options: Any) -> ModelRuntime:
    return build_runtime(
        entry(str(folder), kv_cache={"bits": bits, "group_size": GROUP}, **options)
    )


@pytest.fixture(scope="module")
def quantized8(folder: Path) -> Iterator[ModelRuntime]:
    runtime = runtime_of(folder, 8)
    yield runtime
    runtime.engine.close()


def words(runtime: ModelRuntime, text: str) -> list[int]:
    return list(runtime.tokenizer.encode(text, add_special_tokens=False))


# --- the cache's operations against mlx-lm's float BatchKVCache ---------------------------


def dequantized(parts: tuple[mx.array, ...], bits: int) -> mx.array:
    return mx.dequantize(*parts, group_size=GROUP, bits=bits)


def rounded(x: mx.array, bits: int) -> mx.array:
    return dequantized(tuple(mx.quantize(x, group_size=GROUP, bits=bits)), bits)


def assert_same_rows(q: BatchQuantizedKVCache, f: BatchKVCache, bits: int) -> None:
    """Same bookkeeping, and every used position's keys / values equal the float cache's
    (quantized the same way)."""
    assert (q._idx, q.left_padding.tolist(), q.offset.tolist()) == (
        f._idx, f.left_padding.tolist(), f.offset.tolist(),
    )  # fmt: skip
    assert q.keys is not None and q.values is not None
    for row, start in enumerate(f.left_padding.tolist()):
        for mine, theirs in ((q.keys, f.keys), (q.values, f.values)):
            got = dequantized(mine, bits)[row, :, start : f._idx]
            want = rounded(theirs[row, :, start : f._idx], bits)
            assert mx.array_equal(got, want), row


def rows_of(lengths: list[int], bits: int, seed: int) -> tuple[list[Any], list[Any]]:
    """One-row caches (quantized, float) holding the same random keys and values."""
    mx.random.seed(seed)
    quantized, floats = [], []
    for n in lengths:
        k, v = mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64))
        q, f = QuantizedRowCache(group_size=GROUP, bits=bits), KVCache()
        q.update_and_fetch(k, v)
        f.update_and_fetch(k, v)
        quantized.append(q)
        floats.append(f)
    return quantized, floats


@pytest.mark.parametrize("bits", [8, 4])
def test_cache_operations_keep_the_rows_a_float_cache_keeps(bits: int) -> None:
    qs, fs = rows_of([5, 9, 2], bits, seed=1)
    q, f = BatchQuantizedKVCache.merge(qs), BatchKVCache.merge(fs)
    assert_same_rows(q, f, bits)
    new_k, new_v = mx.random.normal((3, 2, 3, 64)), mx.random.normal((3, 2, 3, 64))
    q.update_and_fetch(new_k, new_v)  # a verification's 3 positions
    f.update_and_fetch(new_k, new_v)
    assert_same_rows(q, f, bits)
    trim_rows([q], [2, 0, 1])  # speculation's rollback: rows trim and roll
    trim_rows([f], [2, 0, 1])
    assert_same_rows(q, f, bits)
    more_q, more_f = rows_of([12], bits, seed=2)
    q.extend(BatchQuantizedKVCache.merge(more_q))  # a row joins the batch
    f.extend(BatchKVCache.merge(more_f))
    assert_same_rows(q, f, bits)
    keep_rows([q], [1, 3], None)  # rows 0 and 2 finish
    keep_rows([f], [1, 3], None)
    assert_same_rows(q, f, bits)
    (row,), _ = row_cache([q], 1, None)
    (want,), _ = row_cache([f], 1, None)
    assert type(row) is QuantizedRowCache and row.offset == want.offset == 12
    assert mx.array_equal(dequantized(row.keys, bits), rounded(want.keys, bits))
    assert row.nbytes < want.nbytes * (0.32 if bits == 8 else 0.2)


def test_prefill_right_padding_is_rolled_like_the_float_cache() -> None:
    q, f = BatchQuantizedKVCache([0, 0], GROUP, 8), BatchKVCache([0, 0])
    for cache in (q, f):
        cache.prepare(lengths=[4, 2], right_padding=[0, 2])
    k, v = mx.random.normal((2, 2, 4, 64)), mx.random.normal((2, 2, 4, 64))
    q.update_and_fetch(k, v)
    f.update_and_fetch(k, v)
    q.finalize()
    f.finalize()
    assert_same_rows(q, f, 8)


# --- generation through the engine ---------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
def test_batch_of_mixed_lengths_equals_mlx_lm_quantized_cache(
    folder: Path, reference: tuple[Any, Any], quantized8: ModelRuntime, bits: int
) -> None:
    runtime = quantized8 if bits == 8 else runtime_of(folder, bits)
    try:
        texts = ["apple " * 40, "pear and plum " * 5, "x"]
        prompts = [words(runtime, text) for text in texts]
        streams = [runtime.engine.submit(job(p, max_tokens=20)) for p in prompts]
        got = [collect(stream).ids for stream in streams]
        assert got == [mlx_lm_ids(reference, p, 20, bits) for p in prompts]
        if bits == 4:  # the cache is quantized: float keys and values decode otherwise here
            assert all(ids != mlx_lm_ids(reference, p, 20, None) for ids, p in zip(got, prompts))
    finally:
        if runtime is not quantized8:
            runtime.engine.close()


def test_prefix_cache_hit_reads_quantized_rows(folder: Path, quantized8: ModelRuntime) -> None:
    prompt = words(quantized8, "banana bread " * 60)
    before = quantized8.engine.stats()["prefix_cache_bytes"]  # earlier tests' entries
    first = collect(quantized8.engine.submit(job(prompt, max_tokens=12)))
    stored = quantized8.engine.stats()["prefix_cache_bytes"] - before
    again = collect(quantized8.engine.submit(job(prompt, max_tokens=12)))
    assert first.usage.cached_tokens == 0 and again.usage.cached_tokens == len(prompt) - 1
    assert again.ids == first.ids
    plain = build_runtime(entry(str(folder)))
    try:
        collect(plain.engine.submit(job(prompt, max_tokens=12)))
        float_bytes = plain.engine.stats()["prefix_cache_bytes"]
    finally:
        plain.engine.close()
    # 8 bits + a float32 scale and bias per 32 elements: 1.25 bytes where float32 takes 4
    assert stored == float_bytes * 1.25 / 4


def run_scheduler(folder: Path, prompts: list[list[int]], speculate: bool) -> list[list[int]]:
    options = EngineOptions(
        max_batch=8,
        kv_cache={"bits": 8, "group_size": GROUP},
        prefix_cache=PrefixCacheOptions(enabled=False),
        speculative=SpeculativeOptions(method="prompt_lookup", tokens=4) if speculate else None,
    )
    stats: dict[str, float] = {}
    batch = Scheduler(load_model(folder, "auto", True), options, stats)
    if batch.speculation is not None:
        batch.speculation.costs = FreeVerification()  # verify on every step, on any machine
    tokenizer = load_tokenizer(folder)
    courier, detokenizers = Courier(), Detokenizers(tokenizer)
    seqs = []
    for key, prompt in enumerate(prompts):
        work = GenerationJob("t", prompt, SamplingParams(temperature=0.0), 24, frozenset())
        seq = RequestState(work, Channel(), detokenizers.new(), tokenizer)
        batch.add(key, seq, courier)
        seqs.append(seq)
    ids: list[list[int]] = [[] for _ in prompts]
    kinds: set[type] = set()
    while batch.seqs:
        batch.step(courier)
        kinds |= {type(c) for c in batch.gen._generation_batch.prompt_cache}
        courier.flush()
        for row, seq in zip(ids, seqs):
            while (got := seq.channel.get(0)) is not None:
                row += [e.token_id for e in got if isinstance(e, TokenText)]
    assert kinds == {BatchQuantizedKVCache}
    if speculate:
        assert stats["speculative_accepted_tokens_total"] > 0
        assert (
            stats["speculative_proposed_tokens_total"] > stats["speculative_accepted_tokens_total"]
        )
    return ids


def test_speculation_trims_rejected_quantized_positions(
    folder: Path, quantized8: ModelRuntime
) -> None:
    code = words(quantized8, CODE)
    prompts = [code, code[5:], words(quantized8, "Hello"), code[2:]]
    assert run_scheduler(folder, prompts, True) == run_scheduler(folder, prompts, False)


def test_n_choices_copy_the_quantized_prompt_kv(folder: Path) -> None:
    runtime = runtime_of(folder, 8, prefix_cache=PrefixCacheOptions(enabled=False))
    try:
        engine = runtime.engine
        prompt = words(runtime, "Tell me a long story about a robot who learns to paint.")
        seeds = [7, 8, 9]
        alone = [
            collect(engine.submit(job(prompt, 16, temperature=1.0, seed=s))).ids for s in seeds
        ]
        before = engine.stats()
        grouped = [
            dataclasses.replace(
                job(prompt, 16, temperature=1.0, seed=s), prompt_group="g", group_size=len(seeds)
            )
            for s in seeds
        ]
        together = [collect(stream).ids for stream in [engine.submit(j) for j in grouped]]
        after = engine.stats()
        assert together == alone and len(set(map(tuple, alone))) == 3
        assert after["shared_prompt_rows_total"] - before["shared_prompt_rows_total"] == 2
        assert after["prefill_tokens_total"] - before["prefill_tokens_total"] == len(prompt) + 2
    finally:
        runtime.engine.close()


def test_a_model_the_cache_cannot_serve_is_a_load_error(
    demo_model_dir: Callable[[str], Path],
) -> None:
    demo_model_dir("qwen3")
    with pytest.raises(RuntimeError, match=r"options.kv_cache .*group size 32"):
        build_runtime(entry("demo:qwen3", kv_cache={"bits": 8, "group_size": 32}))
