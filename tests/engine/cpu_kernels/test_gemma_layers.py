"""Gemma 3's one-op decode steps (engine/cpu_kernels/gemma_layers.py, cache_steps.py)
against mlx-lm's own forward over the same kernel layers: a tiny random Gemma 3 with
projections of mixed quantizations (as a Q4_K_M GGUF has them), sliding-window layers on
mlx-lm's ring buffers (RotatingKVCache, and BatchRotatingKVCache with left padding as the
engine batches them) and global layers, decoding well past the window."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import gemma3_text
from mlx_lm.models.cache import (
    BatchKVCache,
    BatchRotatingKVCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from pipeserve.engine.cpu_kernels.gemma_layers import GemmaBlock, use_gemma_layers
from pipeserve.engine.cpu_kernels.layers import use_fused_ops, use_kernels
from tests.engine.cpu_kernels.test_fused_layers import CountingLayer, close

pytestmark = pytest.mark.mlx

WINDOW = 8
BITS = {"q_proj": 5, "k_proj": 5, "v_proj": 8, "o_proj": 4, "gate_proj": 5, "up_proj": 5,
        "down_proj": 8, "embed_tokens": 8}  # fmt: skip


def tiny_gemma3() -> nn.Module:
    args = gemma3_text.ModelArgs(model_type="gemma3_text", hidden_size=128, num_hidden_layers=4,
                                 intermediate_size=192, num_attention_heads=4, head_dim=32,
                                 num_key_value_heads=2, vocab_size=96, rope_local_base_freq=1e4,
                                 rope_theta=1e6, query_pre_attn_scalar=32,
                                 sliding_window=WINDOW, sliding_window_pattern=2)  # fmt: skip
    model = gemma3_text.Model(args)
    model.sanitize({})  # tied output projection, as a GGUF without output.weight
    return model


def quantize(model: nn.Module) -> None:
    def bits(path: str, module: nn.Module) -> Any:
        if not hasattr(module, "to_quantized"):
            return False
        return {"group_size": 32, "bits": BITS[path.rsplit(".", 1)[-1]]}

    nn.quantize(model, class_predicate=bits)


def twins(ext: Any) -> tuple[nn.Module, nn.Module]:
    """One random Gemma 3 twice: kernel layers with mlx-lm's blocks, and with GemmaBlocks."""
    mx.random.seed(5)
    reference = tiny_gemma3()
    norms = [(k, mx.random.normal(v.shape) * 0.3) for k, v in
             tree_items(reference) if k.endswith("norm.weight")]  # fmt: skip
    reference.load_weights(norms, strict=False)
    quantize(reference)
    weights = reference.parameters()
    models = []
    for _ in range(2):
        model = tiny_gemma3()
        quantize(model)
        model.update(weights)
        assert use_kernels(model, ext) == 4 * 7 + 1
        use_fused_ops(model, ext)
        models.append(model)
    assert use_gemma_layers(models[1], ext) == 4
    return models[0], models[1]


def tree_items(model: nn.Module) -> list[tuple[str, mx.array]]:
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())


def counted(model: nn.Module) -> list[CountingLayer]:
    counters = []
    for block in model.layers:
        assert type(block) is GemmaBlock
        block._decoder = CountingLayer(block._decoder)
        counters.append(block._decoder)
    return counters


def decode(model: nn.Module, cache: list[Any], prompt: mx.array, steps: int) -> np.ndarray:
    logits = model(prompt, cache=cache)[:, -1]
    rows = [logits]
    for _ in range(steps):
        logits = model(mx.argmax(logits, axis=-1)[:, None], cache=cache)[:, -1]
        rows.append(logits)
    return np.array(mx.stack(rows))


@pytest.mark.parametrize(("prompt_length", "ring_calls"), [(5, 15), (11, 13)])
def test_one_op_steps_match_mlx_lm_past_the_window(ext, prompt_length, ring_calls):
    """make_prompt_cache's caches (RotatingKVCache on the sliding layers): a prompt inside
    the window and one longer than it, then 14 steps, the ring wrapping around."""
    per_op, one_op = twins(ext)
    counters = counted(one_op)
    prompt = mx.array([[(7 * i + 3) % 96 for i in range(prompt_length)]])
    want = decode(per_op, make_prompt_cache(per_op), prompt, 14)
    cache = make_prompt_cache(one_op)
    assert [type(c) for c in cache] == [RotatingKVCache, KVCache] * 2
    got = decode(one_op, cache, prompt, 14)
    # The prompt and every step take the op (its buffers made as mlx-lm's update makes
    # them), but on the rings a prompt longer than the window and the first step after it
    # (mlx-lm's update trims the prompt's buffer to the window first).
    assert [c.calls for c in counters] == [ring_calls, 15, ring_calls, 15]
    assert cache[0].offset == prompt_length + 14 and cache[0].keys.shape[2] == WINDOW
    assert close(got, want)


def batch_caches(model: nn.Module, padding: list[int]) -> list[Any]:
    """The caches mlx-lm's BatchGenerator makes for Gemma 3 (as the engine runs it)."""
    return [
        BatchRotatingKVCache(WINDOW, padding) if type(c) is RotatingKVCache else BatchKVCache(padding)
        for c in model.make_cache()
    ]  # fmt: skip


def test_one_op_steps_match_mlx_lm_on_a_padded_batch(ext):
    """Two rows, one left-padded, on BatchRotatingKVCache / BatchKVCache: the rings wrap,
    the left padding slides out of the window as mlx-lm's own update moves it."""
    per_op, one_op = twins(ext)
    counters = counted(one_op)
    prompts = mx.array([[0, 0, 0, 7, 8, 9], [1, 2, 3, 4, 5, 6]])  # row 0: left padding
    results = []
    for model in (per_op, one_op):
        cache = batch_caches(model, [3, 0])
        logits = decode(model, cache, prompts, 12)
        results.append((logits, cache[0].offset.tolist(), cache[0].left_padding.tolist()))
    assert [c.calls for c in counters] == [13, 13, 13, 13]  # the prompt and every step
    assert results[1][1:] == results[0][1:]
    assert close(results[1][0], results[0][0])


def test_float16_gemma_keeps_mlx_lm_blocks(ext):
    model = tiny_gemma3()
    model.set_dtype(mx.float16)
    use_fused_ops(model, ext)
    assert use_gemma_layers(model, ext) == 0
    assert type(model.layers[0]) is gemma3_text.TransformerBlock


def chunked(model: nn.Module, cache: list[Any], chunks: list[mx.array], steps: int,
            lengths: list[int] | None = None) -> np.ndarray:  # fmt: skip
    """The prompt in chunks (each call's caches evaluated, as mlx-lm's prompt loop does;
    `lengths`: right-padded rows, prepared and finalized as its PromptProcessingBatch
    does), then its last tokens and `steps` greedy steps."""
    if lengths is not None:
        width = sum(c.shape[1] for c in chunks)
        for c in cache:
            c.prepare(lengths=lengths, right_padding=[width - n for n in lengths])
    for chunk in chunks[:-1]:
        model(chunk, cache=cache)
        mx.eval([c.state for c in cache])
    if lengths is not None:
        for c in cache:
            c.finalize()
    return decode(model, cache, chunks[-1], steps)


@pytest.mark.parametrize(
    ("padding", "lengths", "ring_calls"),
    [([0], None, 13), ([2, 0], None, 13), ([0, 0], [5, 7], 11)],
)
def test_prompt_chunks_take_the_op(ext, padding, lengths, ring_calls):
    """A prompt in chunks of 3 and 4 tokens (the second on buffers that must grow), then its
    last token and 10 steps past the window, on the engine's caches: one row, a
    left-padded batch, and a right-padded one (mlx-lm's `prepare` / `finalize`: the rings
    leave those chunks to mlx-lm's update until `finalize`, the global layers take them)."""
    per_op, one_op = twins(ext)
    counters = counted(one_op)
    rows = len(padding)
    ids = mx.array([[(5 * i + 11 * r + 1) % 96 for i in range(8)] for r in range(rows)])
    chunks = [ids[:, :3], ids[:, 3:7], ids[:, 7:]]
    results = []
    for model in (per_op, one_op):
        cache = batch_caches(model, padding)
        logits = chunked(model, cache, chunks, 10, lengths)
        results.append((logits, cache[0].offset.tolist(), cache[1].offset.tolist()))
    assert [c.calls for c in counters] == [ring_calls, 13, ring_calls, 13]
    assert results[1][1:] == results[0][1:]
    assert close(results[1][0], results[0][0])


def test_a_verification_and_its_rollback_on_the_rings(ext):
    """A speculative verification's shape: 3 tokens at once after a 3-token prompt (inside
    the 8-token window: the rings take them through the op too), the last 2 trimmed as
    the engine's rollback trims them, then 8 steps past the window."""
    per_op, one_op = twins(ext)
    counters = counted(one_op)
    results = []
    for model in (per_op, one_op):
        cache = batch_caches(model, [0])
        model(mx.array([[3, 9, 27]]), cache=cache)
        verified = model(mx.array([[81 % 96, 5, 6]]), cache=cache)
        for c in cache:
            c.trim(2)
        logits = decode(model, cache, mx.array([[11]]), 8)
        results.append((np.array(verified), logits, cache[0].offset.tolist()))
    assert [c.calls for c in counters] == [11, 11, 11, 11]
    assert results[1][2] == results[0][2]
    assert close(results[1][0], results[0][0]) and close(results[1][1], results[0][1])
