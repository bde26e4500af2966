"""The one-op decode step over a quantized KV cache (`options.kv_cache`;
`ext.DecoderLayer.quantized`, attention_quantized.cpp): the rows it writes are
mx.quantize's bit for bit; its attention over the quantized rows equals MLX's quantized
SDPA (mlx-lm's `quantized_scaled_dot_product_attention`, the per-op path of the same
layer) on the same cache, at 8 and 4 bits, at contexts on both sides of the kernel's
16-position blocks and of the cache's 256-position growth, one row and a left-padded
batch; whole models decode the same greedy tokens either way, and the engine with
`kv_cache: {bits: 8}` on SmolLM2 takes the op (counted) and answers as the per-op path
does, from a prefix-cache hit too, and speculation verifying on the op gives plain
decoding's tokens. Gemma 3's global layers (quantized) take the op beside its float
sliding-window rings."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import qwen3
from mlx_lm.models.cache import QuantizedKVCache
from mlx_lm.utils import load_tokenizer

from pipeserve.engine.base import ModelRuntime
from pipeserve.engine.cpu_kernels import fused_layers
from pipeserve.engine.cpu_kernels.fused_layers import ONE_OP_STEPS
from pipeserve.engine.kv.quantized import BatchQuantizedKVCache
from pipeserve.engine.runtime import build_runtime
from tests.engine.cpu_kernels.test_fused_layers import tiny_llama, tiny_qwen3, twins
from tests.engine.helpers import collect, entry, job

pytestmark = pytest.mark.mlx

GROUP = 32  # the tiny models' heads are 32 wide


def random_rows(shape: tuple[int, ...], seed: int) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed))


def filled(cache: Any, rows: int, heads: int, n: int, seed: int) -> Any:
    """`cache` after n random key / value positions (its own update: mx.quantize)."""
    keys = random_rows((rows, heads, n, 32), seed)
    values = random_rows((rows, heads, n, 32), seed + 1)
    cache.update_and_fetch(keys, values)
    mx.eval(cache.keys, cache.values)
    return cache


def steps_taken() -> int:
    return ONE_OP_STEPS["quantized"]


def assert_same_rows(
    a: tuple[mx.array, ...], b: tuple[mx.array, ...], group: int, bits: int, end: int
) -> None:
    """The positions both caches hold dequantize within one code of each other (the
    layer's two paths compute the new keys in different float order: a scale may move
    by an ulp, a code by one)."""
    x, y = (mx.dequantize(*(p[..., :end, :] for p in parts), group, bits) for parts in (a, b))
    step = mx.maximum(mx.abs(a[1][..., :end, :]), mx.abs(b[1][..., :end, :])).max()
    assert mx.abs(x - y).max().item() <= 1.01 * step.item()
    same = mx.mean(a[0][..., :end, :] == b[0][..., :end, :]).item()
    assert same > 0.95


@pytest.mark.parametrize("bits", [8, 4])
def test_new_rows_are_what_mx_quantize_makes(ext, bits):
    """The op's float twin writes float keys / values; mx.quantize of those rows equals,
    bit for bit, what the quantized op writes from the same input."""
    _, model = twins(tiny_qwen3, ext, True)  # per-head q / k norms before RoPE
    decoder = model.layers[0]._decoder
    x = random_rows((2, 3, 128), 5)
    zeros = mx.zeros((2, 2, 16, 32))
    _, keys, values = decoder(x, zeros, zeros, 4)
    words = mx.zeros((2, 2, 16, 32 * bits // 32), dtype=mx.uint32)
    groups = mx.zeros((2, 2, 16, 1))
    _, q_keys, q_values = decoder.quantized(
        x, (words, groups, groups), (words, groups, groups), GROUP, bits, 4
    )
    for got, floats in ((q_keys, keys), (q_values, values)):
        want = mx.quantize(floats[:, :, 4:7], group_size=GROUP, bits=bits)
        for part, expected in zip(got, want):
            assert np.array_equal(np.array(part[:, :, 4:7]), np.array(expected))
            assert not np.array(part[:, :, 7:]).any()  # nothing else written


def layer_pair(ext: Any) -> tuple[nn.Module, nn.Module]:
    per_op, one_op = twins(tiny_llama, ext, True, per_op_steps=True)
    return per_op.layers[0], one_op.layers[0]


def compare_layer(per_op: nn.Module, one_op: nn.Module, caches: list[Any], x: mx.array,
                  mask: Any) -> None:  # fmt: skip
    before = steps_taken()
    want = per_op(x, mask, caches[0])
    got = one_op(x, mask, caches[1])
    mx.eval(want, got, caches[1].keys, caches[1].values)
    assert steps_taken() == before + 1  # the op ran, not the per-op path
    want_delta, got_delta = np.array(want - x), np.array(got - x)
    assert np.abs(got_delta - want_delta).max() < 1e-4 * np.abs(want_delta).max()
    end = caches[0].offset if type(caches[0]) is QuantizedKVCache else caches[0]._idx
    group, bits = caches[0].group_size, caches[0].bits
    assert_same_rows(caches[0].keys, caches[1].keys, group, bits, end)
    assert_same_rows(caches[0].values, caches[1].values, group, bits, end)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("context", [1, 15, 16, 17, 40, 200])
@pytest.mark.parametrize("tokens", [1, 4])
def test_attention_equals_mlx_quantized_sdpa(ext, bits, context, tokens):
    """One layer, one row: the step's output over a cache of `context` positions (the
    kernel's 16-position blocks full, partial, one past) equals the per-op path's (MLX's
    quantized SDPA on the same quantized rows) within 1e-4 of its largest entry, and
    both caches hold the same codes after it."""
    per_op, one_op = layer_pair(ext)
    caches = [filled(QuantizedKVCache(GROUP, bits), 1, 2, context, 3) for _ in range(2)]
    x = random_rows((1, tokens, 128), 9)
    compare_layer(per_op, one_op, caches, x, None if tokens == 1 else "causal")


@pytest.mark.parametrize("bits", [8, 4])
def test_attention_on_a_left_padded_batch(ext, bits):
    """BatchQuantizedKVCache rows of different lengths (left padding masked), then a
    trim (speculative rollback) and the step again."""
    per_op, one_op = layer_pair(ext)
    caches = []
    for _ in range(2):
        cache = BatchQuantizedKVCache([5, 0], GROUP, bits)
        caches.append(filled(cache, 2, 2, 21, 4))
    for tokens in (1, 3):
        x = random_rows((2, tokens, 128), 10 + tokens)
        compare_layer(per_op, one_op, caches, x, caches[0].make_mask(tokens))
    for cache in caches:
        cache.trim(2)
    compare_layer(per_op, one_op, caches, random_rows((2, 1, 128), 20), caches[0].make_mask(1))


def decode(model: nn.Module, cache: list[Any], prompt: mx.array, steps: int) -> np.ndarray:
    logits = model(prompt, cache=cache)[:, -1]
    rows = [logits]
    for _ in range(steps):
        logits = model(mx.argmax(logits, axis=-1)[:, None], cache=cache)[:, -1]
        rows.append(logits)
    return np.array(mx.stack(rows))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen3])
@pytest.mark.parametrize("length", [11, 254])
def test_whole_model_decodes_as_the_per_op_path(ext, bits, build, length):
    """Greedy decode through two layers with mlx-lm's QuantizedKVCache: the same tokens
    and logits within 1e-3 of the largest; at 254 the step that finds the 256-position
    buffer full grows it on the per-op path, the others take the op."""
    per_op, one_op = twins(build, ext, True, per_op_steps=True)
    prompt = mx.array([[(i * 37) % 90 + 3 for i in range(length)]])
    want = decode(per_op, [QuantizedKVCache(GROUP, bits) for _ in range(2)], prompt, 6)
    before = steps_taken()
    got = decode(one_op, [QuantizedKVCache(GROUP, bits) for _ in range(2)], prompt, 6)
    assert steps_taken() - before == 2 * (5 if length == 254 else 6)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()


def test_a_held_buffer_is_copied_not_written(ext):
    """A prefix-cache entry's quantized rows that the batch still shares stay as they
    were: the op copies the buffers it may not donate."""
    _, one_op = layer_pair(ext)
    cache = filled(QuantizedKVCache(GROUP, 8), 1, 2, 10, 3)
    held = tuple(mx.array(np.array(p)) for p in cache.keys)
    shared = cache.keys  # another holder of the same arrays
    before = ext.cache_copy_bytes()
    mx.eval(one_op(random_rows((1, 1, 128), 9), None, cache))
    assert ext.cache_copy_bytes() > before
    for a, b in zip(shared, held):
        assert np.array_equal(np.array(a), np.array(b))


# --- the engine on SmolLM2 with kv_cache: {bits: 8} ---------------------------------------

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain how a bicycle works, part by part.",
]


@pytest.fixture(scope="module")
def smollm2_pair(smollm2: tuple[Path, Path]) -> Iterator[tuple[ModelRuntime, ModelRuntime]]:
    """SmolLM2 with an 8-bit cache twice: as loaded (the layer ops) and with the layers
    built without their op (`decoder_layer` answering None: MLX's quantized SDPA)."""
    folder = str(smollm2[1])
    kv = {"bits": 8, "group_size": 64}
    fused = build_runtime(entry(folder, kv_cache=kv))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused_layers, "decoder_layer", lambda block, ext: None)
        fallback = build_runtime(entry(folder, kv_cache=kv))
        collect(fallback.engine.submit(job([1, 2, 3], max_tokens=1)))  # loaded under the patch
    yield fused, fallback
    fused.engine.close()
    fallback.engine.close()


def chat_ids(runtime: ModelRuntime, text: str) -> list[int]:
    ids: list[int] = runtime.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    return ids


def leading(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def answers(runtime: ModelRuntime, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy, 24 tokens each, all in one batch."""
    streams = [runtime.engine.submit(job(p, max_tokens=24)) for p in prompts]
    return [collect(stream).ids for stream in streams]


def test_smollm2_8_bit_cache_takes_the_op_and_answers_as_mlx_sdpa(ext, smollm2_pair):
    """Greedy, 24 tokens, four prompts in one batch: the op path (counted) gives the
    per-op path's tokens on at least three prompts whole and 12+ leading tokens on the
    fourth. Not all four: a quantized cache is discontinuous in its input (a key that
    moves by an ulp can change a code by one), so the two paths' logits differ by up to
    ~0.25 on SmolLM2, as the per-op path's own differ (0.25-0.8) when its embeddings
    move by 2^-22; "List three prime numbers." meets a 0.09 top-2 gap at token 14."""
    fused, fallback = smollm2_pair
    prompts = [chat_ids(fused, p) for p in PROMPTS]
    before, copied = steps_taken(), ext.cache_copy_bytes()
    got = answers(fused, prompts)
    taken = steps_taken() - before
    assert taken >= 30 * 20  # one call per layer (30) per batch step: most of the 23+ steps
    assert ext.cache_copy_bytes() == copied  # the batch's buffers written in place
    before = steps_taken()
    want = answers(fallback, prompts)
    assert steps_taken() == before  # the reference never took the op
    shared = sorted(leading(a, b) for a, b in zip(got, want))
    assert shared[1:] == [24, 24, 24] and shared[0] >= 12, shared


def test_smollm2_prefix_cache_hit_on_quantized_rows(smollm2_pair):
    fused, fallback = smollm2_pair
    prompt = chat_ids(fused, "Tell me about the history of paper. " * 6)
    first = collect(fused.engine.submit(job(prompt, max_tokens=16)))
    before = steps_taken()
    again = collect(fused.engine.submit(job(prompt, max_tokens=16)))
    assert again.usage.cached_tokens == len(prompt) - 1
    assert steps_taken() > before
    reference = collect(fallback.engine.submit(job(prompt, max_tokens=16)))
    assert again.ids == first.ids == reference.ids


def test_smollm2_speculation_verifies_on_the_op(smollm2: tuple[Path, Path]) -> None:
    """Prompt-lookup speculation over an 8-bit cache (verifications of up to 5 tokens per
    row through the op, rejected positions trimmed / rolled): the tokens of plain decoding."""
    from tests.engine.kv.test_quantized import CODE, run_scheduler

    folder = smollm2[1]
    tokenizer = load_tokenizer(folder)
    code = list(tokenizer.encode(CODE, add_special_tokens=False))
    prompts = [code, code[5:], list(tokenizer.encode("Hello")), code[2:]]
    before = steps_taken()
    speculated = run_scheduler(folder, prompts, True)
    assert steps_taken() > before
    assert speculated == run_scheduler(folder, prompts, False)


@pytest.mark.parametrize("bits", [8, 4])
def test_gemma3_global_layers_take_the_op_on_a_quantized_cache(ext, bits):
    """Gemma 3 as RowCaches keeps it: the sliding layers' rings float, the global
    layers' caches quantized; every global layer's decode step on the op (its norms
    after o / down, GeGLU), the logits the per-op path's."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from tests.engine.cpu_kernels import test_gemma_layers as gemma

    per_op, one_op = gemma.twins(ext)

    def caches(model: nn.Module) -> list[Any]:
        return [
            QuantizedKVCache(GROUP, bits) if type(c) is KVCache else c
            for c in make_prompt_cache(model)
        ]

    prompt = mx.array([[(7 * i + 3) % 96 for i in range(11)]])
    want = gemma.decode(per_op, caches(per_op), prompt, 10)
    before = steps_taken()
    got = gemma.decode(one_op, caches(one_op), prompt, 10)
    assert steps_taken() - before == 2 * 10  # two global layers, every step
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()


def wide_qwen3(head_dim: int) -> Any:
    def build() -> nn.Module:
        args = qwen3.ModelArgs(model_type="qwen3", hidden_size=128, num_hidden_layers=2,
                               intermediate_size=192, num_attention_heads=4,
                               num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=96,
                               max_position_embeddings=512, rope_theta=1e6, head_dim=head_dim,
                               tie_word_embeddings=True)  # fmt: skip
        return qwen3.Model(args)

    return build


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("head_dim", "group"), [(64, 32), (64, 64), (128, 128), (128, 32)])
def test_other_head_and_group_sizes(ext, bits, head_dim, group):
    """Heads of 64 and 128 in groups of 32, 64 and 128 (1 to 4 groups per head): one
    layer's 2-token step equals the per-op path's, as above."""
    per_op, one_op = twins(wide_qwen3(head_dim), ext, True, per_op_steps=True)
    caches = []
    for _ in range(2):
        cache = QuantizedKVCache(group, bits)
        keys = random_rows((1, 2, 37, head_dim), 3)
        cache.update_and_fetch(keys, random_rows((1, 2, 37, head_dim), 4))
        caches.append(cache)
    x = random_rows((1, 2, 128), 9)
    compare_layer(per_op.layers[0], one_op.layers[0], caches, x, "causal")
