"""The float32 matmul of the CPU kernels (cpu_kernels/f32_matmul.cpp): against a float64
numpy product for 1-4 rows (the kernel) and 7-64 rows (MLX's matmul), odd shapes, with
and without a bias; both weight layouts giving the very same numbers; the panels layout
of output projections (any row count, every row the same bits as alone and as the
few-row kernel's); and the layers that route a model's float32 projections through it."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from pipeserve.engine.cpu_kernels.layers import (
    DenseEmbedding,
    DenseLinear,
    DenseTransposedLinear,
    PanelEmbedding,
    PanelLinear,
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
    table = model.layers[0].weight
    want = (model.layers[2](model.layers[1](x)), model.layers[0].as_linear(x), model.layers[0](ids))
    assert pretranspose_dense_weights(transposed) == 2  # the biased linear stays as it is
    assert use_dense_kernel(model, ext) == 3
    assert use_dense_kernel(transposed, ext) == 3
    assert use_dense_kernel(nn.Sequential(half), ext) == 0
    assert [type(m) for m in model.layers] == [PanelEmbedding, DenseLinear, DenseLinear]
    assert [type(m) for m in transposed.layers] == [
        PanelEmbedding, DenseTransposedLinear, DenseLinear,
    ]  # fmt: skip
    for net in (model, transposed):
        got = (net.layers[2](net.layers[1](x)), net.layers[0].as_linear(x), net.layers[0](ids))
        for g, w in zip(got, want):
            _close(g, np.array(w, dtype=np.float64))
        assert mx.array_equal(got[2], want[2]).item(), "lookups are unchanged"
        assert mx.array_equal(net.layers[0].weight, table).item(), "the table reads back"
        assert "weight_t" not in net.layers[0].parameters(), "one copy of the table"
    assert mx.array_equal(model.layers[0].as_linear(x), transposed.layers[0].as_linear(x)).item()


def _panels_of(ext, w: np.ndarray) -> mx.array:
    return ext.f32_panels(mx.array(w), False)


@pytest.mark.parametrize("n", [1, 16, 127, 128, 300, 1000])
def test_panels_hold_each_columns_weights_in_one_block(ext, n):
    """Panel p holds output columns p * F32_PANEL .. as (k, column) rows, zeros past n; a
    (K, N) weight packs to the same panels as its (N, K) transpose."""
    rng = np.random.default_rng(n)
    w = rng.standard_normal((n, 24)).astype(np.float32)
    width = ext.F32_PANEL
    panels = np.array(_panels_of(ext, w))
    count = -(-n // width)
    padded = np.zeros((count * width, 24), np.float32)
    padded[:n] = w
    assert panels.shape == (count, 24, width)
    assert np.array_equal(panels, padded.reshape(count, width, 24).transpose(0, 2, 1))
    from_kn = ext.f32_panels(mx.array(np.ascontiguousarray(w.T)), True)
    assert np.array_equal(np.array(from_kn), panels)


@pytest.mark.parametrize(
    "rows,k,n", [(1, 512, 1000), (3, 7, 130), (4, 1, 17), (5, 100, 333), (8, 64, 129),
                 (16, 33, 300), (64, 64, 40), (130, 40, 257)],
)  # fmt: skip
@pytest.mark.parametrize("with_bias", [False, True])
def test_panels_match_numpy_and_every_row_is_the_same_alone(ext, rows, k, n, with_bias):
    """Any row count: within float32 sums of numpy's float64 product, each row's outputs
    the very bits it gets alone (a batch never changes a row's logits) and, up to
    F32_MATMUL_MAX_ROWS rows, the few-row kernel's in the other layouts."""
    rng = np.random.default_rng(rows * 7 + n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) if with_bias else None
    bias = None if b is None else mx.array(b)
    panels = _panels_of(ext, w)
    got = ext.f32_matmul_panels(mx.array(x), panels, n, bias)
    _close(got, x.astype(np.float64) @ w.T.astype(np.float64) + (0.0 if b is None else b))
    for row in {0, rows // 2, rows - 1}:
        alone = ext.f32_matmul_panels(mx.array(x[row : row + 1]), panels, n, bias)
        assert mx.array_equal(alone[0], got[row]).item(), f"row {row} differs in the batch"
    if rows <= ext.F32_MATMUL_MAX_ROWS:
        assert mx.array_equal(got, ext.f32_matmul(mx.array(x), mx.array(w), False, bias)).item()


def test_panels_keep_leading_axes_cast_other_dtypes_and_reject_bad_shapes(ext):
    w = mx.random.normal((40, 64))
    panels = ext.f32_panels(w, False)
    x = mx.random.normal((2, 3, 64))
    y = ext.f32_matmul_panels(x, panels, 40)
    assert y.shape == (2, 3, 40) and y.dtype == mx.float32
    assert mx.array_equal(
        y, ext.f32_matmul_panels(x.reshape(6, 64), panels, 40).reshape(2, 3, 40)
    ).item()
    half = x.astype(mx.float16)
    assert mx.array_equal(ext.f32_matmul_panels(half, panels, 40),
                          ext.f32_matmul_panels(half.astype(mx.float32), panels, 40)).item()  # fmt: skip
    empty = ext.f32_matmul_panels(mx.zeros((0, 64)), panels, 40, mx.ones((40,)))
    assert empty.shape == (0, 40)
    with pytest.raises(ValueError, match="last dimension"):
        ext.f32_matmul_panels(mx.zeros((1, 63)), panels, 40)
    with pytest.raises(ValueError, match="does not match the panels"):
        ext.f32_matmul_panels(x, panels, 40 + ext.F32_PANEL)
    with pytest.raises(ValueError, match="bias"):
        ext.f32_matmul_panels(x, panels, 40, mx.zeros((3,)))
    with pytest.raises(ValueError, match="panels"):
        ext.f32_matmul_panels(x, w, 40)
    with pytest.raises(ValueError, match="float32"):
        ext.f32_panels(w.astype(mx.float16), False)


def test_an_untied_output_projection_is_held_as_panels(ext):
    """mlx-lm's `lm_head` (either layout, with or without a bias) multiplies through the
    panels at any row count; other linears keep the few-row kernel."""
    mx.random.seed(9)

    class Head(nn.Module):
        def __init__(self, bias: bool) -> None:
            super().__init__()
            self.proj = nn.Linear(32, 32, bias=False)
            self.lm_head = nn.Linear(32, 200, bias=bias)

    x = mx.random.normal((9, 32))
    for bias in (False, True):
        model = Head(bias)
        want = model.lm_head(x)
        weight = model.lm_head.weight
        if not bias:
            pretranspose_dense_weights(model)
        assert use_dense_kernel(model, ext) == 2
        assert type(model.lm_head) is PanelLinear
        assert type(model.proj) is (DenseLinear if bias else DenseTransposedLinear)
        _close(model.lm_head(x), np.array(want, dtype=np.float64))
        assert mx.array_equal(model.lm_head.weight, weight).item()


class _ReadsItsTable(nn.Module):
    """A model whose code reads its embedding's table (as seed_oss's tied head does)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(300, 32)

    def __call__(self, h: mx.array) -> mx.array:
        return h @ self.embed_tokens.weight.T


def test_an_embedding_whose_table_the_model_reads_keeps_its_layout(ext):
    """A panel table would be rebuilt from the panels on every read of `.weight`: such a
    model keeps the (N, K) / (K, N) twins, which read it for free, same outputs."""
    mx.random.seed(4)
    model = _ReadsItsTable()
    h = mx.random.normal((2, 32))
    want = model(h)
    assert use_dense_kernel(model, ext) == 1
    assert type(model.embed_tokens) is DenseEmbedding
    assert mx.array_equal(model(h), want).item()
