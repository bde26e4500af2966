"""Native CPU kernels for quantized models: the weights stay quantized in memory.

MLX's own quantized matmul on x86 is a scalar single-threaded loop, so without these
kernels quantized weights are dequantized to float32 at load (engine/weights/dtype.py)
and every token reads four to eight times the bytes. `affine_qmm(x, w, scales, biases,
group_size, bits)` multiplies MLX's affine layout (4, 5 or 8 bits, any group size that
is a multiple of 32, float16 or float32 scales and biases) with SIMD (AVX-512 or
AVX2/FMA) and float32 accumulation, output rows split across threads.

    ext = kernels()          # None: unavailable here; the float32 path runs instead

The extension is built once per MLX version and CPU (build.py) and checked against
MLX's dequantize + matmul on every load (`self_test`); it is skipped, with one log
line saying why, when there is no compiler, the build or the check fails, the device
is not the CPU, or PIPESERVE_CPU_KERNELS=off forces the float32 path.
"""

from __future__ import annotations

import logging
import os
import threading
from types import ModuleType
from typing import Any

log = logging.getLogger("pipeserve.engine")

ENV_SWITCH = "PIPESERVE_CPU_KERNELS"  # "off" forces the float32 path
ENV_THREADS = "PIPESERVE_CPU_THREADS"  # threads the kernels split rows over
# Prompt chunks through the integer GEMM (prefill_gemm.cpp), x rounded to int16 per run of
# 32 (on by default); "int8": x rounded to int8 as llama.cpp's Q8_0 (faster, but it moved
# SmolLM2's first greedy token on a batched prefill); "off": the float path
# (docs/cpu-kernels.md).
ENV_PREFILL_GEMM = "PIPESERVE_PREFILL_GEMM"
PREFILL_MODES = ("int16", "int8", "off")
# "off": prompt chunks' attention per query row (attention.cpp) instead of the blocked
# kernel (prefill_attention.cpp).
ENV_PREFILL_ATTENTION = "PIPESERVE_PREFILL_ATTENTION"
# "off": the int16 prompt GEMM on AVX512-VNNI even where AMX tiles are available (the same
# numbers to the bit; AMX is faster).
ENV_PREFILL_AMX = "PIPESERVE_PREFILL_AMX"
BITS = (4, 5, 8)
SELF_TEST_TOLERANCE = 1e-4  # relative to the output's scale; float32 sums differ ~1e-6
# Prompt chunks (prefill_gemm.cpp) round x to int8 per group, as llama.cpp does: ~5e-3 of
# the output's scale on normal data (the float path where the GEMM is not built: ~1e-6).
PREFILL_TOLERANCE = 2e-2
PREFILL_SELF_TEST_ROWS = 72  # more than affine_qmm.cpp's PREFILL_MIN_M

_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}


def forced_off() -> bool:
    return _off(os.environ.get(ENV_SWITCH, ""))


def kernels() -> ModuleType | None:
    """The checked extension (built on first use), or None (logged once per process)
    where it cannot run."""
    with _lock:
        if forced_off():
            if "off" not in _loaded:
                log.info("CPU kernels off (%s=off): quantized weights run as float32", ENV_SWITCH)
                _loaded["off"] = None
            return None
        if "ext" not in _loaded:
            _loaded["ext"] = _load()
        return _loaded["ext"]


def _load() -> ModuleType | None:
    from pipeserve.engine.cpu_kernels.build import BuildError, built_module, import_module
    from pipeserve.settings import pipeserve_home

    try:
        ext = import_module(built_module(pipeserve_home()))
        ext.set_threads(thread_count())
        self_test(ext)
        apply_prefill_mode(ext)
    except (BuildError, OSError, ImportError, AssertionError, ValueError) as exc:
        log.warning("CPU kernels unavailable (%s): quantized weights run as float32", exc)
        return None
    log.info("CPU kernels ready (%s, %d threads)", ext.simd(), ext.threads())
    return ext


def prefill_gemm_mode() -> str:
    """PIPESERVE_PREFILL_GEMM as one of PREFILL_MODES: unset or on means int16."""
    value = os.environ.get(ENV_PREFILL_GEMM, "").strip().lower()
    if _off(value):
        return "off"
    return "int8" if value == "int8" else "int16"


def prefill_gemm_on() -> bool:
    return prefill_gemm_mode() != "off"


def apply_prefill_mode(ext: Any) -> None:
    """The environment's prompt-GEMM mode set on the extension (tests restore it so)."""
    mode = prefill_gemm_mode()
    ext.set_prefill_gemm(mode != "off")
    ext.set_prefill_int8(mode == "int8")
    ext.set_prefill_attention(not _off(os.environ.get(ENV_PREFILL_ATTENTION, "")))
    ext.set_prefill_amx(not _off(os.environ.get(ENV_PREFILL_AMX, "")))


def _off(value: str) -> bool:
    return value.strip().lower() in ("0", "off", "false", "no")


def thread_count() -> int:
    configured = os.environ.get(ENV_THREADS, "").strip()
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    return max(1, len(os.sched_getaffinity(0)))


def self_test(ext: Any) -> None:
    """Every bit width against MLX's dequantize + matmul on random data; AssertionError
    when any differs by more than SELF_TEST_TOLERANCE of the output's magnitude."""
    import mlx.core as mx

    key = mx.random.key(7)
    x = mx.random.normal((3, 128), key=key)
    weights = mx.random.normal((37, 128), key=mx.random.split(key)[1])
    _check_products(ext, x, weights, SELF_TEST_TOLERANCE, "")
    # A prompt chunk: more rows than the decode paths take (prefill_gemm.cpp's int8 GEMM
    # where built), within PREFILL_TOLERANCE.
    chunk = mx.random.normal((PREFILL_SELF_TEST_ROWS, 128), key=mx.random.key(11))
    _check_products(ext, chunk, weights, PREFILL_TOLERANCE, " prefill")
    _self_test_fused(ext, x, weights)
    _self_test_f32_matmul(ext, x, weights)


def _check_products(ext: Any, x: Any, weights: Any, tolerance: float, what: str) -> None:
    """x times every bit width's quantized weights against MLX's dequantize + matmul."""
    import mlx.core as mx

    for bits in BITS:
        w, scales, biases = mx.quantize(weights, group_size=32, bits=bits)
        scales, biases = scales.astype(mx.float16), biases.astype(mx.float16)
        dense = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), 32, bits)
        expected = x @ dense.T
        got = ext.affine_qmm(x, w, scales, biases, 32, bits)
        error = mx.abs(got - expected).max().item()
        scale = mx.abs(expected).max().item()
        assert error <= tolerance * scale, f"self-test: {bits}-bit{what} error {error:.3g}"


def _self_test_fused(ext: Any, x: Any, weights: Any) -> None:
    """RMSNorm, RoPE (both layouts, a transposed input, per-row offsets) and one-row
    attention (grouped heads, with and without a mask) against mx.fast's own."""
    import mlx.core as mx

    checks = [(ext.rms_norm(x, weights[0], 1e-5), mx.fast.rms_norm(x, weights[0], 1e-5))]
    heads = weights[:24].reshape(2, 3, 4, 128).transpose(0, 2, 1, 3)  # (B, H, L, D), strided
    offsets = mx.array([5, 900], dtype=mx.int32)
    for traditional in (False, True):
        for offset in (mx.array([17], dtype=mx.int32), offsets):
            got = ext.rope(heads, 64, traditional, 10000.0, 1.0, offset)
            want = mx.fast.rope(heads, 64, traditional=traditional, base=10000.0, scale=1.0,
                                offset=offset if offset.size > 1 else 17)  # fmt: skip
            checks.append((got, want))
    k1, k2 = mx.random.split(mx.random.key(9))
    q = mx.random.normal((2, 6, 1, 32), key=k1)  # six query heads over two kv heads
    keys = mx.random.normal((2, 2, 5, 32), key=k2)
    mask = mx.array([[True] * 5, [False, False, True, True, True]]).reshape(2, 1, 1, 5)
    for m in (None, mask):
        want = mx.fast.scaled_dot_product_attention(q, keys, keys * 2, scale=0.1, mask=m)
        checks.append((ext.sdpa(q, keys, keys * 2, 0.1, m), want))
    checks += _fused_step_checks(ext, x, weights)
    for tokens in (1, 3):  # a decode step, and a verification step of three tokens
        checks += _decoder_layer_checks(ext, tokens)
    for got, want in checks:
        error = mx.abs(got - want).max().item()
        assert error <= SELF_TEST_TOLERANCE * mx.abs(want).max().item(), f"fused op error {error}"


def _fused_step_checks(ext: Any, x: Any, weights: Any) -> list[tuple[Any, Any]]:
    """The fused-layer ops (fused_step.cpp) and MLX's own on the same data: (got, want)."""
    import mlx.core as mx
    import mlx.nn as nn

    h, normed = ext.add_rms_norm(x, x * 0.5, weights[1], 1e-5)
    qkv = weights[:36].reshape(3, 3, 512)  # B 3, L 3, 2 query + 1 key + 1 value heads of 128
    q, k, v = ext.split_heads(qkv, 2, 1, 64, False, 10000.0, 1.0, mx.array([4], mx.int32),
                              weights[2], None, 1e-6)  # fmt: skip
    heads = qkv.reshape(3, 3, 4, 128).transpose(0, 2, 1, 3)

    def rope(a: Any) -> Any:
        return mx.fast.rope(a, 64, traditional=False, base=10000.0, scale=1.0, offset=4)

    return [
        (h, x * 1.5),
        (normed, mx.fast.rms_norm(x * 1.5, weights[1], 1e-5)),
        (ext.swiglu(weights[:3]), nn.silu(weights[:3, :64]) * weights[:3, 64:]),
        (q, rope(mx.fast.rms_norm(heads[:, :2], weights[2], 1e-6))),
        (k, rope(heads[:, 2:3])),
        (v, heads[:, 3:]),
    ]


def _decoder_layer_checks(ext: Any, tokens: int) -> list[tuple[Any, Any]]:
    """One step of `tokens` new tokens per row through a small layer op (4-bit projections,
    grouped heads, q/k norms, per-row positions, left padding, causal among the new
    tokens) and MLX's own ops on the same data: (got, want)."""
    import mlx.core as mx
    import mlx.nn as nn

    keys = iter(mx.random.split(mx.random.key(5), 12))
    hidden, heads, kv_heads, d, inter, rows, index = 64, 4, 2, 16, 96, 2, 5

    def normal(*shape: int) -> Any:
        return mx.random.normal(shape, key=next(keys))

    def projection(n: int, k: int) -> tuple[Any, ...]:
        w, scales, biases = mx.quantize(normal(n, k) * 0.2, group_size=32, bits=4)
        return w, scales.astype(mx.float16), biases.astype(mx.float16), None, 32, 4

    def linear(a: Any, p: tuple[Any, ...]) -> Any:
        f32 = mx.float32
        return a @ mx.dequantize(p[0], p[1].astype(f32), p[2].astype(f32), 32, 4).T

    qkv_p, o_p = projection((heads + 2 * kv_heads) * d, hidden), projection(hidden, heads * d)
    gate_up_p, down_p = projection(2 * inter, hidden), projection(hidden, inter)
    norm1, norm2, q_norm, k_norm = normal(hidden), normal(hidden), normal(d), normal(d)
    layer = ext.DecoderLayer([[qkv_p], [o_p], [gate_up_p], [down_p]], norm1, norm2, q_norm, k_norm,
                             heads, kv_heads, d, d, False, 1e4, 1.0, d**-0.5, 1e-5, 1e-6)  # fmt: skip
    x, cache_k, cache_v = normal(rows, tokens, hidden), normal(rows, 2, 8, d), normal(rows, 2, 8, d)
    positions = mx.array([3, index], mx.int32)  # row 0: two positions of left padding
    key_at = mx.arange(index + tokens).reshape(1, 1, 1, -1)
    query_at = index + mx.arange(tokens).reshape(1, 1, -1, 1)
    mask = (key_at >= mx.array([2, 0]).reshape(-1, 1, 1, 1)) & (key_at <= query_at)
    out, new_k, new_v = layer(x, cache_k, cache_v, index, positions, mask)

    qkv = linear(mx.fast.rms_norm(x, norm1, 1e-5), qkv_p)
    qkv = qkv.reshape(rows, tokens, -1, d).transpose(0, 2, 1, 3)
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]

    def rope(a: Any, w: Any) -> Any:
        a = mx.fast.rms_norm(a, w, 1e-6)
        return mx.fast.rope(a, d, traditional=False, base=1e4, scale=1.0, offset=positions)

    q, k = rope(q, q_norm), rope(k, k_norm)
    all_k = mx.concatenate([cache_k[:, :, :index], k], axis=2)
    all_v = mx.concatenate([cache_v[:, :, :index], v], axis=2)
    attended = mx.fast.scaled_dot_product_attention(q, all_k, all_v, scale=d**-0.5, mask=mask)
    h = x + linear(attended.transpose(0, 2, 1, 3).reshape(rows, tokens, -1), o_p)
    gate_up = linear(mx.fast.rms_norm(h, norm2, 1e-5), gate_up_p)
    want = h + linear(nn.silu(gate_up[..., :inter]) * gate_up[..., inter:], down_p)
    end = index + tokens
    return [(out, want), (new_k[:, :, :end], all_k), (new_v[:, :, :end], all_v)]


def _self_test_f32_matmul(ext: Any, x: Any, weights: Any) -> None:
    """The few-row float32 matmul in both weight layouts against MLX's matmul, the two
    layouts bit-identical; more rows than the kernel takes go to MLX's own. The panels
    layout (any rows) within the same tolerance, the few-row kernel's bits where it runs."""
    import mlx.core as mx

    bias = weights[5, :37]
    panels = ext.f32_panels(weights, False)
    for rows in (x[:1], x, mx.concatenate([x] * 3)):  # 1, 3 and 9 rows
        want = rows @ weights.T + bias
        nk = ext.f32_matmul(rows, weights, False, bias)
        kn = ext.f32_matmul(rows, mx.contiguous(weights.T), True, bias)
        paneled = ext.f32_matmul_panels(rows, panels, weights.shape[0], bias)
        scale = SELF_TEST_TOLERANCE * mx.abs(want).max().item()
        for name, got in (("f32_matmul", nk), ("f32_matmul_panels", paneled)):
            error = mx.abs(got - want).max().item()
            assert error <= scale, f"{name} {error}"
        kernel = rows.shape[0] <= ext.F32_MATMUL_MAX_ROWS
        assert mx.array_equal(nk, kn).item() or not kernel, "f32_matmul layouts differ"
        assert mx.array_equal(nk, paneled).item() or not kernel, "f32_matmul panels differ"
