"""The integer GEMM for prompt chunks (engine/cpu_kernels/prefill_gemm.cpp: more than 64 rows
of x, AVX512-VNNI builds), in both roundings of x (int16, the default, and int8): against
the float64 product of the exactly rounded x (each row rounded per run of 32 values,
scale = the run's largest magnitude / 32639 or / 127, as the kernel does, whatever the
weights' group size) within float32 summation error, and against the unrounded product
within the rounding's own error; a row's result the same to the bit whatever the other
rows; non-finite x and the switch take the float path."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from pipeserve.engine import cpu_kernels

from .test_cpu_kernels import reference, unpack

# Of the output's largest magnitude: float32 sums against float64 on the same rounded x.
EXACT_TOLERANCE = 2e-5
# The rounding itself, of the output's largest magnitude. int8 (llama.cpp's Q8
# activations): ~5e-3 measured on normal x, up to ~1e-2 with outlier columns sharing a
# run. int16: 256 times finer (measured ~2e-5 with the outliers).
ROUNDING_TOLERANCE = {"int8": cpu_kernels.PREFILL_TOLERANCE, "int16": 1e-4}
LEVELS = {"int8": 127.0, "int16": 32639.0}
ROWS = 65  # affine_qmm.cpp PREFILL_MIN_M + 1


@pytest.fixture(params=["int16", "int8"])
def gemm(ext, request):
    """The extension with the prompt GEMM on in one rounding; the environment's mode after."""
    if not ext.prefill_gemm_built():
        pytest.skip("the prefill GEMM needs an AVX512-VNNI build (float path here)")
    ext.set_prefill_gemm(True)
    ext.set_prefill_int8(request.param == "int8")
    yield ext
    cpu_kernels.apply_prefill_mode(ext)


def rounded_x(x: mx.array, mode: str) -> np.ndarray:
    """x rounded as the kernel rounds it: per row and run of 32, q = rint(x * (L / amax))
    in float32, x' = q * (amax / L), L = 32639 (int16) or 127 (int8)."""
    levels = np.float32(LEVELS[mode])
    v = np.array(x, dtype=np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(v).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, levels / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(v * inv)
    return (q.astype(np.float64) * (amax / levels)).reshape(x.shape)


def quantized(n: int, k: int, group_size: int, bits: int, scale_dtype: str, seed: int):
    w, scales, biases = mx.quantize(
        mx.random.normal((n, k), key=mx.random.key(seed)), group_size, bits
    )
    kind = getattr(mx, scale_dtype)
    return w, scales.astype(kind), biases.astype(kind)


@pytest.mark.parametrize("bits", cpu_kernels.BITS)
@pytest.mark.parametrize("scale_dtype", ["float16", "float32"])
@pytest.mark.parametrize("group_size", [32, 64])
def test_prefill_gemm_matches_the_product_of_the_rounded_x(gemm, bits, scale_dtype, group_size):
    mode = "int8" if gemm.prefill_int8() else "int16"
    # n: a block of 32 output columns and a tail; k: an odd number of 32-groups
    n, k = 45, 352 if group_size == 32 else 320
    w, scales, biases = quantized(n, k, group_size, bits, scale_dtype, bits + group_size)
    outliers = np.where(np.arange(k) % 17 == 0, 60.0, 1.0)
    for rows in (ROWS, 70, 131):
        x = mx.random.normal((rows, k), key=mx.random.key(rows)) * mx.array(outliers, mx.float32)
        got = np.array(gemm.affine_qmm(x, w, scales, biases, group_size, bits))
        q = unpack(np.array(w), bits)
        s = np.repeat(np.array(scales.astype(mx.float32), dtype=np.float64), group_size, axis=1)
        b = np.repeat(np.array(biases.astype(mx.float32), dtype=np.float64), group_size, axis=1)
        exact = rounded_x(x, mode) @ (s * q + b).T
        plain = reference(x, w, scales, biases, group_size, bits)
        top = np.abs(plain).max()
        assert np.abs(got - exact).max() <= EXACT_TOLERANCE * top, rows
        assert np.abs(got - plain).max() <= ROUNDING_TOLERANCE[mode] * top, rows


def test_a_rows_result_does_not_depend_on_the_other_rows(gemm):
    w, scales, biases = quantized(70, 256, 32, 4, "float16", 3)
    x = mx.random.normal((200, 256), key=mx.random.key(5))
    full = np.array(gemm.affine_qmm(x, w, scales, biases, 32, 4))
    for start, rows in ((0, ROWS), (7, 100), (130, 70)):
        part = np.array(gemm.affine_qmm(x[start : start + rows], w, scales, biases, 32, 4))
        assert np.array_equal(part, full[start : start + rows]), (start, rows)


def test_non_finite_x_and_the_switch_take_the_float_path(gemm):
    w, scales, biases = quantized(40, 128, 32, 4, "float16", 9)
    x = mx.random.normal((ROWS, 128), key=mx.random.key(2))
    float_path = reference(x, w, scales, biases, 32, 4)
    gemm.set_prefill_gemm(False)
    try:
        off = np.array(gemm.affine_qmm(x, w, scales, biases, 32, 4))
    finally:
        gemm.set_prefill_gemm(True)
    assert np.abs(off - float_path).max() <= 1e-5 * np.abs(float_path).max()
    on = np.array(gemm.affine_qmm(x, w, scales, biases, 32, 4))
    assert not np.array_equal(on, off)  # the rounding shows
    x[3, 5] = float("nan")
    got = np.array(gemm.affine_qmm(x, w, scales, biases, 32, 4))
    assert not np.isfinite(got[3]).any()
    assert np.abs(got[4] - float_path[4]).max() <= 1e-5 * np.abs(float_path).max()


@pytest.mark.parametrize(("rows", "k", "n", "bits", "group_size"),
                         [(65, 352, 45, 4, 32), (200, 320, 70, 8, 64), (131, 352, 45, 5, 32)])  # fmt: skip
def test_amx_tiles_give_the_vector_paths_bits(ext, rows, k, n, bits, group_size):
    """Where AMX is available the int16 GEMM runs on tiles: the same integer sums, joined
    and scaled by the same operations, so the very bits of the AVX512-VNNI path."""
    if not ext.prefill_gemm_built():
        pytest.skip("the prefill GEMM needs an AVX512-VNNI build (float path here)")
    ext.set_prefill_gemm(True)
    ext.set_prefill_int8(False)
    ext.set_prefill_amx(True)
    try:
        if not ext.prefill_amx():
            pytest.skip("no AMX tiles on this CPU (or the kernel refuses them)")
        for scale_dtype in ("float16", "float32"):
            w, scales, biases = quantized(n, k, group_size, bits, scale_dtype, rows)
            x = mx.random.normal((rows, k), key=mx.random.key(k))
            tiles = ext.affine_qmm(x, w, scales, biases, group_size, bits)
            mx.eval(tiles)  # the switch is read when the op runs
            ext.set_prefill_amx(False)
            vectors = ext.affine_qmm(x, w, scales, biases, group_size, bits)
            mx.eval(vectors)
            ext.set_prefill_amx(True)
            assert mx.array_equal(tiles, vectors), scale_dtype
    finally:
        cpu_kernels.apply_prefill_mode(ext)
