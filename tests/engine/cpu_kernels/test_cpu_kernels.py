"""The native CPU kernels (engine/cpu_kernels): built here with the system compiler,
checked against a numpy reference that unpacks MLX's affine layout on its own, for
every supported bit width, both scale types and batch sizes 1-9, 12, 16, 17 and 64; a
row's result the same to the bit at every batch size of the integer path; the switch
that forces the float32 path; and the thread pool under concurrent streams with
SIGSTOP/SIGCONT, and across fork()."""

from __future__ import annotations

import logging
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from pipeserve.engine import cpu_kernels
from pipeserve.engine.cpu_kernels.layers import KernelEmbedding, KernelLinear, use_kernels

# Of the output's largest magnitude. Up to 64 rows of x the kernel rounds each activation
# to an int16 on the scale of its run of 8 (a relative step of 2^-15 of the run's
# largest magnitude): measured up to ~4e-5 with the outlier columns below, ~1.5e-5
# without (the float path for more rows: float32 sums in another order, ~1e-6).
TOLERANCE = 1e-4
INT_PATH_ROWS = 64  # affine_qmm.cpp INT_MAX_M


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
    # n: full 4-row blocks and a tail; k: several groups of each size, and for group 32
    # an odd number of groups (the integer path's 64-value blocks end in a half block)
    n, k = 37, 352 if group_size == 32 else 320
    w, scales, biases = mx.quantize(mx.random.normal((n, k), key=key), group_size, bits)
    scales, biases = (
        scales.astype(getattr(mx, scale_dtype)),
        biases.astype(getattr(mx, scale_dtype)),
    )
    outliers = mx.array(np.where(np.arange(k) % 17 == 0, 60.0, 1.0), dtype=mx.float32)
    for batch in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 64):
        x = mx.random.normal((batch, k), key=mx.random.key(batch))
        if batch == 5:
            x = x * outliers  # a few large activation columns, as real models have
        got = np.array(ext.affine_qmm(x, w, scales, biases, group_size, bits))
        expected = reference(x, w, scales, biases, group_size, bits)
        assert got.shape == (batch, n)
        assert np.abs(got - expected).max() <= TOLERANCE * np.abs(expected).max(), batch


@pytest.mark.parametrize("bits", cpu_kernels.BITS)
@pytest.mark.parametrize(
    ("group_size", "k", "scale_dtype", "symmetric"),
    [(32, 352, "float16", False), (64, 320, "float32", False), (32, 352, "float16", True)],
)
def test_a_rows_result_is_the_same_to_the_bit_at_every_batch_size(
    ext, bits, group_size, k, scale_dtype, symmetric
):
    """Speculative verification runs a row at W + 1 rows of x that a decode step runs
    alone, and greedy output must not change: every row of the integer path is
    quantized and summed on its own, in one order, whatever the number of rows (odd
    group count and a tail of weight rows included), through every tiling of the
    few-row paths (1-3 rows, the pair tiles of 4-16, the buffered tiles above), both
    scale types, a group size other than 32 and symmetric blocks (no biases)."""
    n = 43
    key = mx.random.key(bits)
    w, scales, biases = mx.quantize(mx.random.normal((n, k), key=key), group_size, bits)
    scales, biases = (a.astype(getattr(mx, scale_dtype)) for a in (scales, biases))
    if symmetric:
        biases = mx.zeros((0,), dtype=scales.dtype)
    x = mx.random.normal((INT_PATH_ROWS, k), key=mx.random.key(7))
    x = x * mx.array(np.where(np.arange(k) % 13 == 0, 50.0, 1.0), dtype=mx.float32)

    def product(rows: mx.array) -> np.ndarray:
        return np.array(ext.affine_qmm(rows, w, scales, biases, group_size, bits))

    alone = np.stack([product(x[m : m + 1])[0] for m in range(INT_PATH_ROWS)])
    for rows in (*range(2, 18), 31, INT_PATH_ROWS):
        assert np.array_equal(product(x[:rows]), alone[:rows]), rows
    assert not np.array_equal(alone[0], alone[1])


@pytest.mark.parametrize("bits", cpu_kernels.BITS)
def test_symmetric_blocks_without_biases_give_the_same_bits(ext, bits):
    """Empty biases: each bias -2^(bits - 1) x its scale (GGUF's Q8_0 / Q4_0 / Q5_0 blocks),
    computed instead of read: the very numbers of the stored biases on every path (the
    integer path of few rows, the float paths of more)."""
    n, k = 37, 352
    key = mx.random.key(bits)
    w = mx.random.randint(0, 2**32 - 1, (n, k * bits // 32), dtype=mx.uint32, key=key)
    scales = (mx.random.uniform(shape=(n, k // 32), key=key) * 0.02).astype(mx.float16)
    biases = scales * -(2 ** (bits - 1))
    empty = mx.zeros((0,), dtype=mx.float16)
    for batch in (1, 3, 9, 70):
        x = mx.random.normal((batch, k), key=mx.random.key(batch))
        stored = np.array(ext.affine_qmm(x, w, scales, biases, 32, bits))
        computed = np.array(ext.affine_qmm(x, w, scales, empty, 32, bits))
        assert np.array_equal(stored, computed), batch


def test_non_finite_activations_stay_non_finite(ext):
    """An infinity or NaN is never quantized into finite integers (the integer path of
    few rows): its row's outputs are non-finite, the other rows right."""
    w, scales, biases = mx.quantize(mx.random.normal((5, 64)), 32, 4)
    x = mx.random.normal((3, 64))
    x[0, 3] = float("inf")
    x[2, 40] = float("nan")
    got = np.array(ext.affine_qmm(x, w, scales, biases, 32, 4))
    assert not np.isfinite(got[[0, 2]]).any()
    expected = reference(x[1:2], w, scales, biases, 32, 4)
    assert np.abs(got[1] - expected).max() <= TOLERANCE * np.abs(expected).max()


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


def test_a_symmetric_embedding_keeps_no_biases(ext):
    """A Q8_0 embedding (biases -128 x scale): the kernel twin drops the biases and
    computes the same lookups and output projection as MLX's layer with them."""
    embedding = nn.QuantizedEmbedding(50, 96, group_size=32, bits=8)
    embedding.biases = embedding.scales * -128
    model = nn.Sequential(embedding)
    x, ids = mx.random.normal((3, 96)), mx.array([[1, 7, 49]])
    expected = (embedding(ids), embedding.as_linear(x))
    use_kernels(model, ext)
    twin = model.layers[0]
    assert twin.biases.size == 0
    for ours, theirs in zip((twin(ids), twin.as_linear(x)), expected, strict=True):
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


def numpy_attention(q, keys, values, scale, mask=None):
    qs, ks, vs = (np.array(a, dtype=np.float64) for a in (q, keys, values))
    group = qs.shape[1] // ks.shape[1]
    ks, vs = np.repeat(ks, group, axis=1), np.repeat(vs, group, axis=1)
    scores = qs @ ks.transpose(0, 1, 3, 2) * scale
    if mask is not None and mask.dtype == mx.bool_:
        scores = np.where(np.array(mask), scores, -np.inf)
    elif mask is not None:
        scores = scores + np.array(mask)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return weights / weights.sum(-1, keepdims=True) @ vs


# Head sizes on the vectorised path (64, 128) and off it (24); lengths around its blocks
# of 16 positions; keys with unit and with strided rows (a transposed buffer).
@pytest.mark.parametrize("dim", [24, 64, 128])
@pytest.mark.parametrize("length", [1, 15, 16, 17, 40])
def test_attention_at_every_head_size_and_length_matches_numpy(ext, dim, length):
    k1, k2, k3, k4 = mx.random.split(mx.random.key(dim + length), 4)
    q = mx.random.normal((2, 4, 2, dim), key=k1)
    keys = mx.random.normal((2, 2, dim, length), key=k2).transpose(0, 1, 3, 2)  # strided
    values = mx.random.normal((2, 2, length, dim), key=k3)
    hidden = np.arange(length)[None, :] < np.array([[0], [length // 2]])  # row 1: padding
    masks = [None, mx.array(~hidden).reshape(2, 1, 1, length),
             mx.random.normal((2, 4, 2, length), key=k4)]  # fmt: skip
    for mask in masks:
        got = np.array(ext.sdpa(q, keys, values, dim**-0.5, mask))
        want = numpy_attention(q, keys, values, dim**-0.5, mask)
        assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()


def test_a_query_gets_the_same_numbers_alone_or_among_others(ext):
    """Speculative verification relies on it: the last of 8 causal query rows, in a batch
    of 3, is bit-identical to that row decoded alone after the other 7."""
    k1, k2, k3 = mx.random.split(mx.random.key(9), 3)
    q = mx.random.normal((3, 9, 8, 64), key=k1)
    keys, values = (
        mx.random.normal((3, 3, 70, 64), key=k2),
        mx.random.normal((3, 3, 70, 64), key=k3),
    )
    together = ext.sdpa(q, keys, values, 0.125, None, False, True)
    alone = ext.sdpa(q[1:2, :, 7:], keys[1:2], values[1:2], 0.125, None, False, True)
    assert mx.array_equal(together[1:2, :, 7:], alone)


@pytest.mark.parametrize("dim", [24, 64])
@pytest.mark.parametrize("padding", [1, 5, 16])
def test_left_padding_leaves_a_row_bit_identical(ext, dim, padding):
    """A batch left-pads its shorter rows (masked positions in front, as many as the
    longest row needs, and speculation's rollback shifts them): a row's attention must
    not change by a bit with them, or sampled output differs with speculation on."""
    k1, k2, k3 = mx.random.split(mx.random.key(padding), 3)
    q = mx.random.normal((1, 4, 3, dim), key=k1)
    keys, values = (
        mx.random.normal((1, 2, 37, dim), key=k2),
        mx.random.normal((1, 2, 37, dim), key=k3),
    )
    plain = ext.sdpa(q, keys, values, 0.3, None, False, True)
    junk = mx.random.normal((1, 2, padding, dim)) * 100
    padded_keys, padded_values = (mx.concatenate([junk, a], axis=2) for a in (keys, values))
    mask = mx.array(np.arange(37 + padding) >= padding).reshape(1, 1, 1, -1)
    causal = mx.array(np.tril(np.ones((3, 37 + padding), bool), k=34 + padding))
    padded = ext.sdpa(q, padded_keys, padded_values, 0.3, mask & causal)
    assert mx.array_equal(plain, padded)


# The stress child: three threads, each on its own MLX stream, issue small affine_qmm
# calls through a 2-thread pool (several chunks per call) and check every result against
# the numpy reference the parent saved. They print "ready" once each has one call done,
# keep calling until the parent creates the stop file (or STRESS_MAX_CALLS each), then
# print "ok <calls per thread>".
STRESS_CHILD = """
import os, sys, threading
import mlx.core as mx, numpy as np
from pipeserve.engine import cpu_kernels
ext = cpu_kernels.kernels()
assert ext is not None, "kernels unavailable in the child"
ext.set_threads(2)
data = np.load(sys.argv[1])
stop, max_calls, tolerance = sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
w, scales, biases = (mx.array(data[name]) for name in ("w", "scales", "biases"))
started = threading.Barrier(4)
failures, counts = [], []

def issue(index):
    x, expected = mx.array(data[f"x{index}"]), data[f"expected{index}"]
    limit = tolerance * np.abs(expected).max()
    with mx.stream(mx.new_stream(mx.cpu)):
        for call in range(max_calls):
            got = np.array(ext.affine_qmm(x, w, scales, biases, 32, 4))
            if np.abs(got - expected).max() > limit:
                failures.append(index)
            if call == 0:
                started.wait()
            if call % 50 == 0 and os.path.exists(stop):
                break
    counts.append(call + 1)

threads = [threading.Thread(target=issue, args=(i,)) for i in range(3)]
for t in threads: t.start()
started.wait()
print("ready", flush=True)
for t in threads: t.join()
assert not failures, f"wrong results on threads {failures}"
print("ok", *counts, flush=True)
"""
STRESS_MAX_CALLS = 50_000  # per thread: a bound, should the stop file never be seen
STRESS_PAUSES = 60  # SIGSTOP/SIGCONT pairs while the child's threads are calling
HANG_SECONDS = 240  # generous: a shared, loaded 2-core machine; a hang never ends


def thread_states(pid: int) -> str:
    """Each thread's state and kernel wait channel, from /proc (no debugger needed)."""
    lines = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
            wchan = (task / "wchan").read_text()
            lines.append(f"tid {task.name}: state {stat[0]} utime {stat[11]} wchan {wchan}")
        except OSError:
            continue
    return "\n".join(lines)


def test_pool_survives_concurrent_streams_and_sigstop(ext, tmp_path):
    """Regression guard for the pool's wait loop (a server once hung with its stream
    thread spinning on `done == chunks`, after a SIGSTOP/SIGCONT): the child must finish
    every call, correctly, however often it is stopped and continued."""
    n, k = 1024, 256  # four pool chunks per one-row call
    w, scales, biases = mx.quantize(mx.random.normal((n, k), key=mx.random.key(3)), 32, 4)
    arrays = {"w": np.array(w), "scales": np.array(scales), "biases": np.array(biases)}
    for index, batch in enumerate((1, 1, 2)):
        x = mx.random.normal((batch, k), key=mx.random.key(40 + index))
        arrays[f"x{index}"] = np.array(x)
        arrays[f"expected{index}"] = reference(x, w, scales, biases, 32, 4)
    np.savez(tmp_path / "stress.npz", **arrays)  # type: ignore[arg-type]
    stop = tmp_path / "stop"
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            STRESS_CHILD,
            str(tmp_path / "stress.npz"),
            str(stop),
            str(STRESS_MAX_CALLS),
            str(TOLERANCE),
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    if select.select([child.stdout], [], [], HANG_SECONDS)[0]:
        assert child.stdout.readline() == "ready\n", (
            child.stderr.read()[-3000:] if child.stderr else ""
        )
    rng = random.Random(5)
    for _ in range(STRESS_PAUSES):
        time.sleep(rng.uniform(0.01, 0.08))
        child.send_signal(signal.SIGSTOP)
        time.sleep(rng.uniform(0.001, 0.02))
        child.send_signal(signal.SIGCONT)
    stop.touch()
    try:
        out, err = child.communicate(timeout=HANG_SECONDS)
    except subprocess.TimeoutExpired:
        states = thread_states(child.pid)
        child.kill()
        child.communicate()
        pytest.fail(f"the stress child hung; its threads:\n{states}")
    assert child.returncode == 0, err[-3000:]
    assert out.split()[0] == "ok", out
    assert all(0 < int(calls) <= STRESS_MAX_CALLS for calls in out.split()[1:]), out


# The fork child: one thread keeps the pool busy on its own stream while the main thread
# forks; each forked process runs the kernel on a new stream of its own and exits 0 when
# the result is right. A pool carried over a fork holds the parent's half-done call and
# locks; the kernels must build a fresh one in the forked process instead.
FORK_CHILD = """
import os, sys, threading, time
import mlx.core as mx, numpy as np
from pipeserve.engine import cpu_kernels
ext = cpu_kernels.kernels()
ext.set_threads(2)
data = np.load(sys.argv[1])
forks, hang_seconds = int(sys.argv[2]), float(sys.argv[3])
w, scales, biases, x = (mx.array(data[name]) for name in ("w", "scales", "biases", "x0"))
expected = data["expected0"]
stop = threading.Event()

def busy():
    with mx.stream(mx.new_stream(mx.cpu)):
        while not stop.is_set():
            mx.eval(ext.affine_qmm(x, w, scales, biases, 32, 4))

def forked():
    with mx.stream(mx.new_stream(mx.cpu)):
        got = np.array(ext.affine_qmm(x, w, scales, biases, 32, 4))
    os._exit(0 if np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max() else 3)

thread = threading.Thread(target=busy)
thread.start()
hung, wrong = 0, 0
for _ in range(forks):
    time.sleep(0.01)
    pid = os.fork()
    if pid == 0:
        forked()
    deadline = time.monotonic() + hang_seconds
    while (status := os.waitpid(pid, os.WNOHANG)) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            hung += 1
            break
        time.sleep(0.01)
    else:
        wrong += status[1] != 0
stop.set()
thread.join()
print("hung", hung, "wrong", wrong, flush=True)
"""
FORKS = 20
FORK_HANG_SECONDS = 30  # per forked process; it needs milliseconds


def test_pool_is_rebuilt_in_a_forked_process(ext, tmp_path):
    n, k = 1024, 256
    w, scales, biases = mx.quantize(mx.random.normal((n, k), key=mx.random.key(4)), 32, 4)
    x = mx.random.normal((1, k), key=mx.random.key(41))
    arrays = {"w": w, "scales": scales, "biases": biases, "x0": x}
    saved = {name: np.array(value) for name, value in arrays.items()}
    saved["expected0"] = reference(x, w, scales, biases, 32, 4)
    np.savez(tmp_path / "fork.npz", **saved)  # type: ignore[arg-type]
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            FORK_CHILD,
            str(tmp_path / "fork.npz"),
            str(FORKS),
            str(FORK_HANG_SECONDS),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=FORKS * FORK_HANG_SECONDS + 120,
        check=False,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.split() == ["hung", "0", "wrong", "0"], child.stdout


def test_every_kernel_source_is_hashed_and_shipped_in_the_package():
    """A source file missing from the build key would reuse a stale build; one missing
    from the package data would make every wheel install fall back to float32."""
    import fnmatch
    import tomllib

    from pipeserve.engine.cpu_kernels.build import SOURCE_FILES, SOURCES

    on_disk = {p.name for p in SOURCES.iterdir() if p.suffix in (".cpp", ".h", ".txt")}
    assert on_disk == set(SOURCE_FILES)
    pyproject = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())
    shipped = pyproject["tool"]["setuptools"]["package-data"]["pipeserve"]
    package_dir = SOURCES.relative_to(SOURCES.parents[1])  # engine/cpu_kernels
    unshipped = [
        name
        for name in SOURCE_FILES
        if not any(fnmatch.fnmatch(f"{package_dir}/{name}", pattern) for pattern in shipped)
    ]
    assert unshipped == []
