"""The native CPU kernels (engine/cpu_kernels): built here with the system compiler,
checked against a numpy reference that unpacks MLX's affine layout on its own, for
every supported bit width, both scale types and batch sizes 1, 2, 7 and 64; and the
switch that forces the float32 path."""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from pipeserve.engine import cpu_kernels
from pipeserve.engine.cpu_kernels.build import missing_tools
from pipeserve.engine.cpu_kernels.layers import KernelEmbedding, KernelLinear, use_kernels

TOLERANCE = 2e-5  # of the output's largest magnitude: float32 sums in another order


@pytest.fixture(scope="module")
def ext() -> Any:
    if missing_tools():
        pytest.skip(f"no {' / '.join(missing_tools())} to build the CPU kernels")
    if cpu_kernels.forced_off():
        pytest.skip(f"{cpu_kernels.ENV_SWITCH}=off")
    module = cpu_kernels.kernels()
    assert module is not None, "the CPU kernels failed to build or self-test (see the log)"
    return module


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """MLX affine packing (rows, K * bits / 32) uint32 -> (rows, K) integers: value i of
    a row at bits i * bits .. of the row's little-endian bit stream."""
    rows = packed.shape[0]
    stream = np.unpackbits(packed.view(np.uint8).reshape(rows, -1), axis=1, bitorder="little")
    fields = stream.reshape(rows, -1, bits).astype(np.int64)
    return (fields << np.arange(bits)).sum(axis=2)


def reference(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
              bits: int) -> np.ndarray:  # fmt: skip
    q = unpack(np.array(w), bits)
    s = np.repeat(np.array(scales.astype(mx.float32), dtype=np.float64), group_size, axis=1)
    b = np.repeat(np.array(biases.astype(mx.float32), dtype=np.float64), group_size, axis=1)
    return np.array(x, dtype=np.float64) @ (s * q + b).T


@pytest.mark.parametrize("bits", cpu_kernels.BITS)
@pytest.mark.parametrize("scale_dtype", ["float16", "float32"])
@pytest.mark.parametrize("group_size", [32, 64])
def test_kernel_matches_numpy_reference(ext, bits, scale_dtype, group_size):
    key = mx.random.key(bits * 100 + group_size)
    n, k = 37, 320  # n: full 4-row blocks and a tail; k: several groups of each size
    w, scales, biases = mx.quantize(mx.random.normal((n, k), key=key), group_size, bits)
    scales, biases = (
        scales.astype(getattr(mx, scale_dtype)),
        biases.astype(getattr(mx, scale_dtype)),
    )
    for batch in (1, 2, 7, 64):
        x = mx.random.normal((batch, k), key=mx.random.key(batch))
        got = np.array(ext.affine_qmm(x, w, scales, biases, group_size, bits))
        expected = reference(x, w, scales, biases, group_size, bits)
        assert got.shape == (batch, n)
        assert np.abs(got - expected).max() <= TOLERANCE * np.abs(expected).max(), batch


def test_kernel_keeps_leading_dimensions_and_rejects_bad_shapes(ext):
    w, scales, biases = mx.quantize(mx.random.normal((8, 64)), 32, 4)
    x = mx.random.normal((2, 3, 64))
    got = ext.affine_qmm(x, w, scales, biases, 32, 4)
    assert got.shape == (2, 3, 8)
    flat = ext.affine_qmm(x.reshape(6, 64), w, scales, biases, 32, 4)
    assert np.array_equal(np.array(got).reshape(6, 8), np.array(flat))
    with pytest.raises(ValueError, match="packed width"):
        ext.affine_qmm(mx.zeros((1, 96)), w, scales, biases, 32, 4)
    with pytest.raises(ValueError, match="bits"):
        ext.affine_qmm(x, w, scales, biases, 32, 3)


def test_kernel_layers_match_mlx_quantized_layers(ext):
    linear = nn.QuantizedLinear(96, 40, bias=True, group_size=32, bits=5)
    embedding = nn.QuantizedEmbedding(50, 96, group_size=32, bits=8)
    model = nn.Sequential(linear, embedding)
    x = mx.random.normal((3, 96))
    ids = mx.array([[1, 7, 49]])
    expected = (linear(x), embedding(ids), embedding.as_linear(x))
    assert use_kernels(model, ext) == 2
    kernel_linear, kernel_embedding = model.layers
    assert isinstance(kernel_linear, KernelLinear)
    assert isinstance(kernel_embedding, KernelEmbedding)
    got = (kernel_linear(x), kernel_embedding(ids), kernel_embedding.as_linear(x))
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.dtype == mx.float32
        assert mx.allclose(ours, theirs.astype(mx.float32), rtol=1e-3, atol=1e-3).item()


def test_switch_forces_the_float32_path(monkeypatch, caplog):
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "off")
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    with caplog.at_level(logging.INFO, logger="pipeserve.engine"):
        assert cpu_kernels.kernels() is None
        assert cpu_kernels.kernels() is None
    assert [r.message for r in caplog.records].count(
        f"CPU kernels off ({cpu_kernels.ENV_SWITCH}=off): quantized weights run as float32"
    ) == 1


def numpy_rope(x: np.ndarray, dims: int, traditional: bool, base: float, positions: np.ndarray
               ) -> np.ndarray:  # fmt: skip
    """x (B, H, L, D); positions (B, L)."""
    half = dims // 2
    angles = positions[:, None, :, None] * base ** (-2.0 * np.arange(half) / dims)  # B,1,L,half
    cos, sin = np.cos(angles), np.sin(angles)
    out = x.astype(np.float64).copy()
    first = (slice(None),) * 3
    i1 = first + ((slice(0, dims, 2),) if traditional else (slice(0, half),))
    i2 = first + ((slice(1, dims, 2),) if traditional else (slice(half, dims),))
    x1, x2 = out[i1].copy(), out[i2].copy()
    out[i1], out[i2] = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    return out


@pytest.mark.parametrize("traditional", [False, True])
def test_fused_rope_and_rms_norm_match_numpy(ext, traditional):
    key = mx.random.key(3)
    x = mx.random.normal((2, 5, 4, 96), key=key)  # B, L, H, D: transposed to B, H, L, D
    heads = x.transpose(0, 2, 1, 3)
    offsets = np.array([3, 700])
    got = ext.rope(heads, 64, traditional, 10000.0, 1.0, mx.array(offsets, dtype=mx.int32))
    positions = offsets[:, None] + np.arange(5)[None, :]
    expected = numpy_rope(np.array(heads), 64, traditional, 10000.0, positions)
    assert np.abs(np.array(got) - expected).max() < 1e-4
    weight = mx.random.normal((96,), key=mx.random.key(4))
    norm = np.array(ext.rms_norm(x, weight, 1e-5))
    xs = np.array(x, dtype=np.float64)
    want = xs / np.sqrt((xs**2).mean(-1, keepdims=True) + 1e-5) * np.array(weight)
    assert np.abs(norm - want).max() < 1e-4 * np.abs(want).max()


def test_fused_attention_matches_numpy(ext):
    k1, k2, k3 = mx.random.split(mx.random.key(5), 3)
    q = mx.random.normal((2, 6, 1, 64), key=k1)  # 6 query heads over 2 kv heads
    cache = mx.random.normal((2, 2, 16, 64), key=k2)  # a cache buffer: S = 16 used of it
    keys, values = cache[:, :, :11], mx.random.normal((2, 2, 11, 64), key=k3)
    mask = mx.array(np.arange(11)[None, :] >= np.array([[0], [4]]))  # row 1: left padding
    for m in (None, mask.reshape(2, 1, 1, 11)):
        got = np.array(ext.sdpa(q, keys, values, 0.125, m))
        qs, ks, vs = (np.array(a, dtype=np.float64) for a in (q, keys, values))
        ks, vs = np.repeat(ks, 3, axis=1), np.repeat(vs, 3, axis=1)
        scores = qs @ ks.transpose(0, 1, 3, 2) * 0.125
        if m is not None:
            scores = np.where(np.array(m), scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        expected = weights / weights.sum(-1, keepdims=True) @ vs
        assert np.abs(got - expected).max() < 1e-5 * np.abs(expected).max()
