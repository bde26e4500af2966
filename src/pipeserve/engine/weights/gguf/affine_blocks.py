"""GGUF block types whose every 32 weights are `scale * q + bias` with one unsigned
integer q each: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K (eight
32-weight sub-blocks, scale d * sc and bias -dmin * m). That is exactly MLX's affine
format at group size 32, so these are repacked, not re-quantized: the integers as
stored, MLX's bit layout (one little-endian bit stream per row), float16 scales and
biases. Exact but for the float16 rounding of a K sub-block's d * sc and dmin * m
(relative 2^-11).
"""

from __future__ import annotations

import numpy as np

AFFINE_BITS: dict[str, int] = {
    "Q4_0": 4,
    "Q4_1": 4,
    "Q5_0": 5,
    "Q5_1": 5,
    "Q8_0": 8,
    "Q4_K": 4,
    "Q5_K": 5,
}

Decoded = tuple[np.ndarray, np.ndarray, np.ndarray]  # q (n, groups, 32), scale, bias (n, groups)


def _f16(raw: np.ndarray) -> np.ndarray:
    """A 2-byte column of each block as float32 (n, 1)."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: the low nibbles are weights 0-15, the high ones 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """4 bytes -> bit j of the little-endian word, for weights j = 0..31."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _legacy(blocks: np.ndarray, kind: str) -> Decoded:
    d = _f16(blocks[:, 0:2])
    if kind == "Q8_0":
        q = (blocks[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return q[:, None], d, -128 * d
    if kind == "Q4_0":
        return _nibbles(blocks[:, 2:18])[:, None], d, -8 * d
    if kind == "Q4_1":
        return _nibbles(blocks[:, 4:20])[:, None], d, _f16(blocks[:, 2:4])
    if kind == "Q5_0":
        q = _nibbles(blocks[:, 6:22]) | (_high_bits(blocks[:, 2:6]) << 4)
        return q[:, None], d, -16 * d
    q = _nibbles(blocks[:, 8:24]) | (_high_bits(blocks[:, 4:8]) << 4)  # Q5_1
    return q[:, None], d, _f16(blocks[:, 2:4])


def _k_quant(blocks: np.ndarray, kind: str) -> Decoded:
    from gguf.quants import Q4_K

    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])  # eight 6-bit scales and mins
    qs = blocks[:, 16:144] if kind == "Q4_K" else blocks[:, 48:176]
    # 32 bytes serve two sub-blocks: low nibbles the first, high nibbles the second.
    shifts = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = ((qs.reshape(n, 4, 1, 32) >> shifts) & 0x0F).reshape(n, 8, 32)
    if kind == "Q5_K":  # bit j of byte i: the fifth bit of weight i of sub-block j
        planes = np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
        q |= ((blocks[:, 16:48].reshape(n, 1, 1, 32) >> planes) & 1).reshape(n, 8, 32) << 4
    return q, d * sc.astype(np.float32), -dmin * m.astype(np.float32)


def decode(blocks: np.ndarray, kind: str) -> Decoded:
    """Raw blocks (n, bytes) of `kind` -> integers, scales and biases per 32 weights."""
    return _k_quant(blocks, kind) if kind.endswith("_K") else _legacy(blocks, kind)


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned integers (rows, cols) -> MLX's packing (rows, cols * bits / 32) uint32:
    value i of a row at bits i * bits.. of the row's little-endian bit stream. Works on
    units of 32 values (`bits` words each), one shift per value position; position-major
    so each step runs over contiguous memory (6-10x faster than unit-major)."""
    rows = q.shape[0]
    positions = np.ascontiguousarray(q.reshape(-1, 32).T).astype(np.uint32)
    words = np.zeros((bits, positions.shape[1]), dtype=np.uint32)
    for i in range(32):
        word, shift = divmod(i * bits, 32)
        words[word] |= positions[i] << np.uint32(shift)
        if shift + bits > 32:  # the value runs on into the next word
            words[word + 1] |= positions[i] >> np.uint32(32 - shift)
    return np.ascontiguousarray(words.T).reshape(rows, -1)
