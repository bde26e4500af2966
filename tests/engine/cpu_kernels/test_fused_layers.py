"""The fused llama-style layers (engine/cpu_kernels/fused_layers.py): each new op against
numpy, whole tiny models (llama with 4-bit kernel projections, qwen3 in float32, with
mlx-lm's KVCache and its left-padded BatchKVCache) against mlx-lm's own forward, and the
one-op decode step (ext.DecoderLayer) against the per-op path of the same layers."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama, qwen2, qwen3
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from pipeserve.engine.cpu_kernels.fused_layers import (
    FusedAttention,
    FusedBlock,
    FusedMLP,
    SideBySide,
    use_fused_layers,
)
from pipeserve.engine.cpu_kernels.layers import KernelLinear, use_fused_ops, use_kernels
from tests.engine.cpu_kernels.test_cpu_kernels import numpy_rope

pytestmark = pytest.mark.mlx


def rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * weight


def test_add_rms_norm_and_swiglu_match_numpy(ext):
    k1, k2, k3 = mx.random.split(mx.random.key(1), 3)
    x, r = mx.random.normal((2, 3, 64), key=k1), mx.random.normal((2, 64, 3), key=k2)
    residual = r.transpose(0, 2, 1)  # strided, as a view would be
    weight = mx.random.normal((64,), key=k3)
    h, normed = ext.add_rms_norm(x, residual, weight, 1e-5)
    want_h = np.array(x, dtype=np.float64) + np.array(residual, dtype=np.float64)
    assert np.abs(np.array(h) - want_h).max() < 1e-6 * np.abs(want_h).max()
    want = rms(want_h, np.array(weight), 1e-5)
    assert np.abs(np.array(normed) - want).max() < 1e-5 * np.abs(want).max()
    gate_up = np.array(mx.random.normal((2, 3, 2 * 40), key=k1), dtype=np.float64)
    gate, up = gate_up[..., :40], gate_up[..., 40:]
    want = gate / (1 + np.exp(-gate)) * up
    got = np.array(ext.swiglu(mx.array(gate_up.astype(np.float32))))
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()
    with pytest.raises(ValueError):
        ext.swiglu(mx.zeros((2, 3)))


def test_swiglu_split_over_the_pool_equals_row_by_row(ext):
    """Enough elements for the kernels' pool (a prefill): every element as computed alone,
    on contiguous and strided inputs alike."""
    gate_up = mx.random.normal((70, 2 * 100), key=mx.random.key(2))
    strided = mx.random.normal((2 * 100, 70), key=mx.random.key(3)).T  # a view, not copied
    for x in (gate_up, strided):
        whole = np.array(ext.swiglu(x))
        rows = np.concatenate([np.array(ext.swiglu(x[i : i + 1])) for i in range(70)])
        assert np.array_equal(whole, rows)
        gate, up = np.array(x[:, :100], np.float64), np.array(x[:, 100:], np.float64)
        want = gate / (1 + np.exp(-gate)) * up
        assert np.abs(whole - want).max() < 1e-5 * np.abs(want).max()


def test_swiglu_at_the_edges_of_float32_exp(ext):
    """The vectorised exp: 0 and inf at the ends of its range, each element within a few
    float32 ulps of numpy's silu elsewhere (relative, not only against the largest)."""
    gate = np.array([-1000, -104, -88, -87.5, -86, -30, -1e-3, 0, 1e-3, 5, 87.5, 89, 1000])
    gate_up = np.concatenate([gate, np.full_like(gate, 1.5)]).astype(np.float32)[None]
    got = np.array(ext.swiglu(mx.array(gate_up)))[0]
    with np.errstate(over="ignore"):  # exp(1000) is inf in float64 too: silu -> -0
        want = gate / (1 + np.exp(-gate.astype(np.float64))) * 1.5
    assert np.all(np.isfinite(got))
    assert np.abs(got - want).max() <= 4e-7 * np.abs(want).max()
    assert np.all(np.abs(got - want) <= 1e-6 * np.abs(want) + 1e-37)


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("norms", [False, True])
def test_split_heads_matches_numpy(ext, traditional, norms):
    q_heads, kv_heads, d, rope_dims, length = 6, 2, 32, 16, 3
    keys = mx.random.split(mx.random.key(2), 3)
    qkv = mx.random.normal((2, length, (q_heads + 2 * kv_heads) * d), key=keys[0])
    q_norm = mx.random.normal((d,), key=keys[1]) if norms else None
    k_norm = mx.random.normal((d,), key=keys[2]) if norms else None
    offsets = np.array([4, 300])
    q, k, v = ext.split_heads(qkv, q_heads, kv_heads, rope_dims, traditional, 10000.0, 1.0,
                              mx.array(offsets, dtype=mx.int32), q_norm, k_norm, 1e-6)  # fmt: skip
    x = np.array(qkv, dtype=np.float64).reshape(2, length, -1, d).transpose(0, 2, 1, 3)
    wq, wk, wv = x[:, :q_heads], x[:, q_heads : q_heads + kv_heads], x[:, q_heads + kv_heads :]
    if norms:
        wq, wk = rms(wq, np.array(q_norm), 1e-6), rms(wk, np.array(k_norm), 1e-6)
    positions = offsets[:, None] + np.arange(length)[None, :]
    wq = numpy_rope(wq, rope_dims, traditional, 10000.0, positions)
    wk = numpy_rope(wk, rope_dims, traditional, 10000.0, positions)
    for got, want in ((q, wq), (k, wk), (v, wv)):
        assert got.shape == want.shape
        assert np.abs(np.array(got) - want).max() < 1e-4 * np.abs(want).max()


def test_attention_merges_heads(ext):
    k1, k2 = mx.random.split(mx.random.key(3))
    q, kv = mx.random.normal((2, 4, 3, 16), key=k1), mx.random.normal((2, 2, 9, 16), key=k2)
    split = ext.sdpa(q, kv, kv * 0.5, 0.25, None)
    merged = ext.sdpa(q, kv, kv * 0.5, 0.25, None, merge_heads=True)
    assert merged.shape == (2, 3, 64)
    assert mx.array_equal(merged, split.transpose(0, 2, 1, 3).reshape(2, 3, 64))


@pytest.mark.parametrize("merge_heads", [False, True])
def test_causal_attention_matches_numpy(ext, merge_heads):
    k1, k2, k3 = mx.random.split(mx.random.key(4), 3)
    q = mx.random.normal((2, 6, 5, 32), key=k1)  # 5 new rows after 4 cached positions
    keys, values = mx.random.normal((2, 2, 9, 32), key=k2), mx.random.normal((2, 2, 9, 32), key=k3)
    got = np.array(ext.sdpa(q, keys, values, 0.2, None, merge_heads, causal=True))
    qs, ks, vs = (np.array(a, dtype=np.float64) for a in (q, keys, values))
    ks, vs = np.repeat(ks, 3, axis=1), np.repeat(vs, 3, axis=1)
    seen = np.arange(9)[None, :] <= np.arange(5)[:, None] + 4
    scores = np.where(seen, qs @ ks.transpose(0, 1, 3, 2) * 0.2, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    want = weights / weights.sum(-1, keepdims=True) @ vs
    if merge_heads:
        want = want.transpose(0, 2, 1, 3).reshape(2, 5, -1)
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()


def tiny_llama() -> nn.Module:
    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2,
                           intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=96, tie_word_embeddings=False)  # fmt: skip
    return llama.Model(args)


def tiny_qwen3() -> nn.Module:
    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=128, num_hidden_layers=2,
                           intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-6, vocab_size=96, max_position_embeddings=512,
                           rope_theta=1e6, head_dim=32, tie_word_embeddings=True)  # fmt: skip
    return qwen3.Model(args)


def quantize_4bit(model: nn.Module) -> None:
    nn.quantize(model, group_size=32, bits=4)


def twins(build: Any, ext: Any, quantize: bool, one_op_steps: bool = True,
          per_op_steps: bool = False, quantizer: Any = quantize_4bit,
          ) -> tuple[nn.Module, nn.Module]:  # fmt: skip
    """Two copies of one random model: the kernel / one-op layout (fused too, decode steps
    per op, if `per_op_steps`), and that plus fusion."""
    mx.random.seed(11)
    reference = build()
    if quantize:
        quantizer(reference)
    weights = reference.parameters()
    models = []
    for _ in range(2):
        model = build()
        if quantize:
            quantizer(model)
        model.update(weights)
        if quantize:
            use_kernels(model, ext)
        use_fused_ops(model, ext)
        models.append(model)
    if per_op_steps:
        assert use_fused_layers(models[0], ext, one_op_steps=False) == 2
    assert use_fused_layers(models[1], ext, one_op_steps) == 2
    return models[0], models[1]


def decode(model: nn.Module, cache: list[Any], prompt: mx.array, steps: int) -> np.ndarray:
    """The logits of the prompt's last position, then of `steps` greedy steps."""
    logits = model(prompt, cache=cache)[:, -1]
    rows = [logits]
    for _ in range(steps):
        logits = model(mx.argmax(logits, axis=-1)[:, None], cache=cache)[:, -1]
        rows.append(logits)
    return np.array(mx.stack(rows))


@pytest.mark.parametrize("family", ["llama-q4", "qwen3-f32"])
def test_fused_model_matches_mlx_lm(ext, family):
    build, quantize = (tiny_llama, True) if family == "llama-q4" else (tiny_qwen3, False)
    plain, fused = twins(build, ext, quantize)
    layer = fused.layers[0]
    assert type(layer) is FusedBlock
    assert type(layer.self_attn) is FusedAttention and type(layer.mlp) is FusedMLP
    projection = layer.self_attn.qkv_proj
    assert type(projection) is (KernelLinear if quantize else nn.Linear)
    prompt = mx.array([[5, 17, 3, 88, 41, 9, 60, 2, 33, 70, 12]])  # 11 rows: the prefill path
    want = decode(plain, make_prompt_cache(plain), prompt, 6)
    got = decode(fused, make_prompt_cache(fused), prompt, 6)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_fused_model_matches_mlx_lm_on_a_padded_batch(ext):
    plain, fused = twins(tiny_qwen3, ext, False)
    prompts = mx.array([[0, 0, 0, 7, 8, 9], [1, 2, 3, 4, 5, 6]])  # row 0: left padding
    results = []
    for model in (plain, fused):
        cache = [BatchKVCache(left_padding=[3, 0]) for _ in model.layers]
        results.append(decode(model, cache, prompts, 4))
    want, got = results
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


def test_other_layers_keep_mlx_lm_forward(ext):
    model = tiny_llama()
    model.layers[0].mlp.up_proj = nn.Linear(128, 192, bias=True)  # not stackable with gate
    use_fused_ops(model, ext)
    use_fused_layers(model, ext)
    assert type(model.layers[0].mlp) is llama.MLP
    assert type(model.layers[1].mlp) is FusedMLP
    half = tiny_llama()
    half.set_dtype(mx.float16)  # float16 activations: the fused ops take float32 only
    use_fused_ops(half, ext)
    assert use_fused_layers(half, ext) == 0
    assert type(half.layers[0]) is llama.TransformerBlock


def tiny_llama_with_biases() -> nn.Module:
    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2,
                           intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=96, tie_word_embeddings=False,
                           attention_bias=True, mlp_bias=True)  # fmt: skip
    return llama.Model(args)


class CountingLayer:
    """A block's DecoderLayer that counts its steps (to see the one-op path ran)."""

    def __init__(self, layer: Any) -> None:
        self.layer, self.calls = layer, 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        return self.layer(*args)


def counted(model: nn.Module) -> list[CountingLayer]:
    counters = []
    for block in model.layers:
        assert block._decoder is not None
        block._decoder = CountingLayer(block._decoder)
        counters.append(block._decoder)
    return counters


def close(got: np.ndarray, want: np.ndarray) -> bool:
    same_argmax = bool((got.argmax(-1) == want.argmax(-1)).all())
    return same_argmax and float(np.abs(got - want).max()) < 1e-4 * float(np.abs(want).max())


@pytest.mark.parametrize("build", [tiny_llama, tiny_llama_with_biases, tiny_qwen3])
def test_one_op_steps_match_the_per_op_path(ext, build):
    """Batch 1 with KVCache (qwen3: per-head q/k norms; the bias variant: biased
    projections), quantized: every decode step through the layer op."""
    per_op, one_op = twins(build, ext, True, per_op_steps=True)
    assert per_op.layers[0]._decoder is None
    counters = counted(one_op)
    prompt = mx.array([[5, 17, 3, 88, 41, 9, 60, 2, 33, 70, 12]])
    want = decode(per_op, make_prompt_cache(per_op), prompt, 6)
    got = decode(one_op, make_prompt_cache(one_op), prompt, 6)
    assert [c.calls for c in counters] == [6, 6]
    assert close(got, want)


def test_one_op_steps_on_a_padded_batch_then_trimmed(ext):
    """A left-padded BatchKVCache, then a trim (speculative rollback) and more steps."""
    per_op, one_op = twins(tiny_llama, ext, True, per_op_steps=True)
    counters = counted(one_op)
    prompts = mx.array([[0, 0, 0, 7, 8, 9], [1, 2, 3, 4, 5, 6]])  # row 0: left padding
    results = []
    for model in (per_op, one_op):
        cache = [BatchKVCache(left_padding=[3, 0]) for _ in model.layers]
        before = decode(model, cache, prompts, 4)
        for layer in cache:
            layer.trim(2)
        after = decode(model, cache, mx.array([[3], [4]]), 3)
        results.append((before, after, cache[0].offset.tolist()))
    assert counters[0].calls == 8  # 4 steps, then the 1-token "prompt" and 3 steps
    assert results[1][2] == results[0][2] == [9, 12]
    assert close(results[1][0], results[0][0]) and close(results[1][1], results[0][1])


def test_one_op_steps_across_a_cache_buffer_boundary(ext):
    """KVCache buffers grow by 256 positions: the step that finds a full buffer takes the
    per-op path (the cache grows it), the next ones the layer op again."""
    per_op, one_op = twins(tiny_llama, ext, True, per_op_steps=True)
    counters = counted(one_op)
    prompt = mx.array([list(range(1, 90)) * 3][:1])[:, :254]
    want = decode(per_op, make_prompt_cache(per_op), prompt, 5)
    got = decode(one_op, make_prompt_cache(one_op), prompt, 5)
    assert counters[0].calls == 4  # steps at 254, 255, 257, 258; 256 grew the buffer
    assert close(got, want)


def test_one_op_step_leaves_a_held_cache_buffer_alone(ext):
    """Functional semantics: a buffer something else still holds (a prefix-cache entry)
    is copied, not written in place."""
    _, model = twins(tiny_llama, ext, True)
    cache = make_prompt_cache(model)
    logits = model(mx.array([[5, 17, 3, 88]]), cache=cache)[:, -1]
    mx.eval(logits)
    held = cache[0].keys
    before = np.array(held)
    logits = model(mx.argmax(logits, axis=-1)[:, None], cache=cache)
    mx.eval(logits, cache[0].keys)
    assert np.array_equal(np.array(held), before)
    assert not np.array_equal(np.array(cache[0].keys)[:, :, 4], before[:, :, 4])


def verify(model: nn.Module, cache: list[Any], tokens: list[list[int]]) -> np.ndarray:
    """The logits of every position of one pass of `tokens` (a verification's W)."""
    return np.array(model(mx.array(tokens), cache=cache))


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen3])
def test_verify_steps_match_the_per_op_path(ext, build):
    """KVCache ("causal" mask): steps of several tokens through the layer op, a trim in
    between (speculative rollback); more tokens than the op takes go per op."""
    per_op, one_op = twins(build, ext, True, per_op_steps=True)
    counters = counted(one_op)
    prompt = [[5, 17, 3, 88, 41, 9, 60, 2, 33, 70, 12]]
    steps = [[[7, 1, 44, 3]], "trim 3", [[9, 2, 8]], [[61]], [list(range(20, 36))],
             [list(range(40, 57))]]  # fmt: skip
    results = []
    for model in (per_op, one_op):
        cache = make_prompt_cache(model)
        outputs = [verify(model, cache, prompt)]
        for step in steps:
            if isinstance(step, str):
                for layer in cache:
                    layer.trim(int(step.split()[1]))
            else:
                outputs.append(verify(model, cache, step))
        results.append((outputs, cache[0].offset))
    assert counters[0].calls == 4  # W 4, 3, 1, 16; the prompt and W 17 per op
    assert results[1][1] == results[0][1] == 11 + 4 - 3 + 3 + 1 + 16 + 17
    for got, want in zip(results[1][0], results[0][0], strict=True):
        assert close(got, want)


def test_verify_steps_on_a_padded_batch_then_trimmed(ext):
    """A left-padded BatchKVCache (its (B, 1, L, S) mask): steps of several tokens, a
    trim, and more steps; the per-row positions and offsets as the per-op path's."""
    per_op, one_op = twins(tiny_llama, ext, True, per_op_steps=True)
    counters = counted(one_op)
    prompts = [[0, 0, 0, 7, 8, 9], [1, 2, 3, 4, 5, 6]]  # row 0: left padding
    steps = [[[4, 5, 6, 7], [8, 9, 10, 11]], [[30, 31], [32, 33]], [[3], [4]]]
    results = []
    for model in (per_op, one_op):
        cache = [BatchKVCache(left_padding=[3, 0]) for _ in model.layers]
        outputs = [verify(model, cache, prompts), verify(model, cache, steps[0])]
        for layer in cache:
            layer.trim(3)
        outputs += [verify(model, cache, step) for step in steps[1:]]
        results.append((outputs, cache[0].offset.tolist(), cache[0]._idx))
    assert counters[0].calls == 3
    assert results[1][1:] == results[0][1:] == ([7, 10], 10)
    for got, want in zip(results[1][0], results[0][0], strict=True):
        assert close(got, want)


def tiny_qwen2() -> nn.Module:
    args = qwen2.ModelArgs(model_type="qwen2", hidden_size=128, num_hidden_layers=2,
                           intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-6, vocab_size=96, rope_theta=1e6,
                           tie_word_embeddings=False)  # fmt: skip
    return qwen2.Model(args)


# A Q4_K_M file's kinds: q / k / o / gate / up Q5_0 (5 bits, symmetric), v Q8_0 (8 bits,
# symmetric), down Q6_K (re-quantized: 8 bits with biases), the output Q8_0.
Q4_K_M_BITS = {"v_proj": 8, "down_proj": 8, "lm_head": 8, "embed_tokens": 8}
ASYMMETRIC = ("down_proj",)


def quantize_like_q4_k_m(model: nn.Module) -> None:
    """Each layer at its Q4_K_M width, the symmetric kinds' biases -2^(bits - 1) x their
    scales (as the GGUF converter writes Q5_0 / Q8_0 blocks)."""

    def params(path: str, module: nn.Module) -> dict[str, int] | bool:
        if not hasattr(module, "to_quantized"):
            return False
        return {"group_size": 32, "bits": Q4_K_M_BITS.get(path.split(".")[-1], 5)}

    nn.quantize(model, class_predicate=params)
    for path, module in model.named_modules():
        if isinstance(module, nn.QuantizedLinear) and path.split(".")[-1] not in ASYMMETRIC:
            scales = module.scales.astype(mx.float16)
            module.scales, module.biases = scales, scales * -(2 ** (module.bits - 1))


def test_mixed_kinds_take_the_one_op_step(ext):
    """Q4_K_M's mixed projections (q / k 5-bit, v 8-bit: not stackable) run as a stage of
    several parts, in the per-op path and in the layer op alike; the symmetric ones hold no
    biases (the kernel computes them from the scales). Against mlx-lm's own forward with
    MLX's quantized layers and against the per-op path."""
    mx.random.seed(11)  # the weights twins draws
    reference = tiny_qwen2()
    quantize_like_q4_k_m(reference)
    per_op, one_op = twins(tiny_qwen2, ext, True, per_op_steps=True,
                           quantizer=quantize_like_q4_k_m)  # fmt: skip
    for model in (per_op, one_op):
        attention = model.layers[0].self_attn
        assert type(attention) is FusedAttention and type(attention.qkv_proj) is SideBySide
        q, k, v = attention.qkv_proj.parts
        assert (q.bits, v.bits) == (5, 8) and q.biases.size == v.biases.size == 0
        assert model.layers[0].mlp.down_proj.biases.size > 0  # not symmetric: kept
        assert model.lm_head.biases.size == 0
    counters = counted(one_op)
    prompt = mx.array([[5, 17, 3, 88, 41, 9, 60, 2, 33, 70, 12]])
    want = decode(reference, make_prompt_cache(reference), prompt, 6)
    per_op_logits = decode(per_op, make_prompt_cache(per_op), prompt, 6)
    got = decode(one_op, make_prompt_cache(one_op), prompt, 6)
    assert [c.calls for c in counters] == [6, 6]
    assert close(got, per_op_logits)
    assert close(got, want)
