"""The few-row float32 matmul of the CPU kernels (cpu_kernels/f32_matmul.cpp): against a
float64 numpy product for 1-4 rows (the kernel) and 7-64 rows (MLX's matmul), odd
shapes, with and without a bias; both weight layouts giving the very same numbers; and
the layers that route a model's float32 projections through it."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from pipeserve.engine.cpu_kernels.layers import (
    DenseEmbedding,
    DenseLinear,
    DenseTransposedEmbedding,
    DenseTransposedLinear,
    use_dense_kernel,
)
from pipeserve.engine.cpu_kernels.transposed import pretranspose_dense_weights

TOLERANCE = 2e-6  # of the output's largest magnitude: float32 sums against float64


def _close(got: mx.array, want: np.ndarray) -> None:
    error = np.abs(np.array(got, dtype=np.float64) - want).max()
    assert error <= TOLERANCE * max(1.0, np.abs(want).max()), error


# (rows, K, N): panels of 128 columns, single vectors of 16 and single columns all met
@pytest.mark.parametrize(
    "rows,k,n",
    [
        (1, 512, 1000),
        (2, 100, 333),
        (3, 7, 130),
        (4, 1, 17),
        (7, 513, 260),
        (8, 64, 129),
        (9, 33, 17),
        (64, 64, 40),
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_numpy_in_both_layouts(ext, rows, k, n, with_bias):
    rng = np.random.default_rng(rows * 1000 + n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) if with_bias else None
    want = x.astype(np.float64) @ w.T.astype(np.float64) + (0.0 if b is None else b)
    bias = None if b is None else mx.array(b)
    nk = ext.f32_matmul(mx.array(x), mx.array(w), False, bias)
    kn = ext.f32_matmul(mx.array(x), mx.array(np.ascontiguousarray(w.T)), True, bias)
    _close(nk, want)
    _close(kn, want)
    if rows <= ext.F32_MATMUL_MAX_ROWS:
        assert mx.array_equal(nk, kn).item(), "the kernel's two layouts must agree exactly"


def test_keeps_leading_dimensions_and_rejects_bad_shapes(ext):
    x = mx.random.normal((2, 1, 64))
    w = mx.random.normal((64, 48))
    y = ext.f32_matmul(x, w, True)
    assert y.shape == (2, 1, 48)
    assert mx.allclose(y, x @ w, rtol=1e-5, atol=1e-5).item()
    with pytest.raises(ValueError, match="last dimension"):
        ext.f32_matmul(x, w, False)
    with pytest.raises(ValueError, match="bias"):
        ext.f32_matmul(x, w, True, mx.zeros((3,)))
    with pytest.raises(ValueError, match="float32"):
        ext.f32_matmul(x, w.astype(mx.float16), True)


def test_other_input_dtypes_take_mlx_matmul(ext):
    x = mx.random.normal((1, 32)).astype(mx.float16)
    w = mx.random.normal((32, 8))
    assert mx.array_equal(ext.f32_matmul(x, w, True), x @ w).item()


def test_layers_route_float32_projections_in_both_layouts(ext):
    mx.random.seed(5)
    model = nn.Sequential(nn.Embedding(300, 64), nn.Linear(64, 96, bias=False), nn.Linear(96, 64))
    transposed = nn.Sequential(
        nn.Embedding(300, 64), nn.Linear(64, 96, bias=False), nn.Linear(96, 64)
    )
    transposed.update(model.parameters())
    half = nn.Linear(64, 8)
    half.set_dtype(mx.float16)
    x = mx.random.normal((3, 64))
    ids = mx.array([[1, 299, 7]])
    want = (model.layers[2](model.layers[1](x)), model.layers[0].as_linear(x), model.layers[0](ids))
    assert pretranspose_dense_weights(transposed) == 2  # the biased linear stays as it is
    assert use_dense_kernel(model, ext) == 3
    assert use_dense_kernel(transposed, ext) == 3
    assert use_dense_kernel(nn.Sequential(half), ext) == 0
    assert [type(m) for m in model.layers] == [DenseEmbedding, DenseLinear, DenseLinear]
    assert [type(m) for m in transposed.layers] == [
        DenseTransposedEmbedding, DenseTransposedLinear, DenseLinear,
    ]  # fmt: skip
    for net in (model, transposed):
        got = (net.layers[2](net.layers[1](x)), net.layers[0].as_linear(x), net.layers[0](ids))
        for g, w in zip(got, want):
            _close(g, np.array(w, dtype=np.float64))
        assert mx.array_equal(got[2], want[2]).item(), "lookups are unchanged"
    assert mx.array_equal(model.layers[0].as_linear(x), transposed.layers[0].as_linear(x)).item()
