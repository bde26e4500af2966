"""The blocked attention for prompt chunks (engine/cpu_kernels/prefill_attention.cpp: 32 or
more query positions, causal, unmasked or a boolean mask) against MLX's own
scaled_dot_product_attention:
grouped-query heads (groups 1, 3, 7), head sizes 32 / 64 / 128, a fresh prompt and a chunk
after cached keys, keys sliced from a larger cache buffer, merged heads; a row's numbers
the same to the bit whatever the other rows of its chunk and with or without left padding;
the switch takes the per-row path (attention.cpp)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

# Of the output's largest magnitude: float32 sums in another order than MLX's.
TOLERANCE = 2e-5


def qkv(batch: int, heads: int, kv_heads: int, length: int, keys: int, dim: int, seed: int):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((batch, heads, length, dim), key=k1)
    # a cache buffer with room past the used keys: strided (B, Hk, S, D) slices
    k = mx.random.normal((batch, kv_heads, keys + 13, dim), key=k2)[:, :, :keys]
    v = mx.random.normal((batch, kv_heads, keys + 13, dim), key=k3)[:, :, :keys]
    return q, k, v


def mlx_reference(q: mx.array, k: mx.array, v: mx.array, scale: float, causal: bool):
    """MLX's SDPA; causal as an explicit mask (row l sees keys up to S - L + l)."""
    length, keys = q.shape[2], k.shape[2]
    mask = None
    if causal:
        seen = np.arange(keys)[None, :] <= np.arange(length)[:, None] + keys - length
        mask = mx.array(seen)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


@pytest.fixture
def blocked(ext):
    ext.set_prefill_attention(True)
    yield ext
    from pipeserve.engine.cpu_kernels import apply_prefill_mode

    apply_prefill_mode(ext)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(9, 3, 64), (14, 2, 64), (4, 4, 32), (8, 2, 128)]
)
@pytest.mark.parametrize(("length", "keys"), [(70, 70), (45, 300), (33, 33)])
@pytest.mark.parametrize("causal", [True, False])
def test_blocked_attention_matches_mlx_sdpa(blocked, heads, kv_heads, dim, length, keys, causal):
    q, k, v = qkv(2, heads, kv_heads, length, keys, dim, heads + length + dim)
    scale = dim**-0.5
    got = blocked.sdpa(q, k, v, scale, None, False, causal)
    want = mlx_reference(q, k, v, scale, causal)
    top = mx.abs(want).max().item()
    assert mx.abs(got - want).max().item() <= TOLERANCE * top
    merged = blocked.sdpa(q, k, v, scale, None, True, causal)
    assert mx.array_equal(merged, got.transpose(0, 2, 1, 3).reshape(2, length, -1))


def test_a_rows_numbers_do_not_depend_on_its_chunk(blocked):
    """Rows 40..95 of a 96-token causal prefill, as their own chunk after 40 cached keys,
    and rows 40..71 before the rest exist: bit-identical to the whole prefill's."""
    q, k, v = qkv(1, 9, 3, 96, 96, 64, 5)
    whole = blocked.sdpa(q, k, v, 0.125, None, False, True)
    tail = blocked.sdpa(q[:, :, 40:], k, v, 0.125, None, False, True)
    middle = blocked.sdpa(q[:, :, 40:72], k[:, :, :72], v[:, :, :72], 0.125, None, False, True)
    assert mx.array_equal(tail, whole[:, :, 40:])
    assert mx.array_equal(middle, whole[:, :, 40:72])


def test_the_switch_takes_the_per_row_path(blocked):
    q, k, v = qkv(1, 9, 3, 64, 64, 64, 8)
    on = blocked.sdpa(q, k, v, 0.125, None, False, True)
    mx.eval(on)  # the switch is read when the op runs
    blocked.set_prefill_attention(False)
    off = blocked.sdpa(q, k, v, 0.125, None, False, True)
    mx.eval(off)
    want = mlx_reference(q, k, v, 0.125, True)
    top = mx.abs(want).max().item()
    assert not mx.array_equal(on, off)  # another order of sums
    for got in (on, off):
        assert mx.abs(got - want).max().item() <= TOLERANCE * top


def padded(a: mx.array, padding: int, seed: int) -> mx.array:
    junk = mx.random.normal((*a.shape[:2], padding, a.shape[3]), key=mx.random.key(seed)) * 100
    return mx.concatenate([junk, a], axis=2)


@pytest.mark.parametrize("padding", [1, 5, 40])
def test_a_left_padded_batch_row_keeps_its_numbers(blocked, padding):
    """A batch left-pads its shorter rows (the engine's boolean mask: causal and padding):
    a row's numbers are the same to the bit as without the padding, the padded positions'
    own rows are zeros (they see nothing), and all of it agrees with MLX's SDPA."""
    q, k, v = qkv(1, 9, 3, 64, 64, 64, padding)
    plain = blocked.sdpa(q, k, v, 0.125, None, False, True)
    qp, kp, vp = padded(q, padding, 1), padded(k, padding, 2), padded(v, padding, 3)
    total = 64 + padding
    seen = np.tril(np.ones((total, total), bool)) & (np.arange(total) >= padding)[None, :]
    mask = mx.array(seen).reshape(1, 1, total, total)
    got = blocked.sdpa(qp, kp, vp, 0.125, mask, False, False)
    assert mx.array_equal(got[:, :, padding:], plain)
    assert not mx.any(got[:, :, :padding]).item()
    want = mx.fast.scaled_dot_product_attention(qp, kp, vp, scale=0.125, mask=mask)
    top = mx.abs(want[:, :, padding:]).max().item()
    assert mx.abs(got[:, :, padding:] - want[:, :, padding:]).max().item() <= TOLERANCE * top


def test_a_boolean_mask_of_any_shape_matches_mlx_sdpa(blocked):
    q, k, v = qkv(2, 8, 2, 40, 100, 64, 12)
    mask = mx.random.uniform(shape=(2, 8, 40, 100), key=mx.random.key(3)) > 0.3
    got = blocked.sdpa(q, k, v, 0.125, mask, True, False)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    want = want.transpose(0, 2, 1, 3).reshape(2, 40, -1)
    assert mx.abs(got - want).max().item() <= TOLERANCE * mx.abs(want).max().item()
