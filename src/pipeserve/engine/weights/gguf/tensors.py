"""One GGUF tensor at a time as MLX arrays (`mx.load` would read a whole file at once,
and refuses the K-quants and Q5_0 / Q5_1).

- F32 / F16 / BF16: as stored.
- Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K: repacked exactly as MLX affine at
  group size 32 (affine_blocks.py).
- Q2_K / Q3_K / Q6_K: their scales cover 16 weights, which no MLX group size matches, so
  gguf-py decodes them and they are re-quantized at group size 32, two bits wider than
  stored (capped at MLX's 8) so the second rounding's step is about a quarter of the
  file's own. Q2_K / Q3_K through `mx.quantize` (added error, RMS relative to the
  weights' RMS, random K blocks: Q3_K -> 5 bit 3.5%, Q2_K -> 4 bit 4.9%). Q6_K
  (d x sc x (q - 32), q 6-bit, one signed 8-bit sc per 16 weights) -> 8 bit symmetric
  (`q6_k_symmetric`): per 32 weights the step is a quarter of the larger of the two
  sub-blocks' steps d x sc (float16, its sign kept), so that sub-block's integers are
  4 (q - 32), exact but for the step's float16 rounding, and the other's values are
  rounded to that grid (half a step; one step where a 128 clips to 127); the bias is
  -128 x the scale, which the kernels derive (no biases held or read). Added error on
  Qwen2.5-Coder-0.5B's twelve Q6_K matrices 0.39-0.45% (`mx.quantize` at 8 bits with
  biases: 0.48-0.51%, and 1/9 more bytes; at 6 bits 1.9%).

Memory stays bounded: one tensor at a time, decoded in row chunks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeserve.engine.weights.gguf.affine_blocks import AFFINE_BITS, decode, pack

REQUANT_BITS: dict[str, int] = {"Q2_K": 4, "Q3_K": 5, "Q6_K": 8}
# MXFP4 (gpt-oss's experts): 32 E2M1 codes under one E8M0 exponent, which is MLX's own
# `mxfp4` mode: the codes and exponents are repacked, exact.
MODES: dict[str, str] = {"MXFP4": "mxfp4"}  # MLX quantization mode where not affine
QUANT_WIDTHS: dict[str, int] = {**AFFINE_BITS, **REQUANT_BITS, "MXFP4": 4}  # MLX bits
GROUP_SIZE = 32
_CHUNK_WEIGHTS = 1 << 22  # weights decoded at once (16 MB as float32, 32 MB as bits)


def read_tensor(tensor: Any) -> dict[str, Any]:
    """One gguf-py ReaderTensor as MLX arrays: {"weight": ...} for float types, plus
    "scales" / "biases" for the quantized ones."""
    import mlx.core as mx
    from gguf import dequantize

    kind = tensor.tensor_type.name
    shape = tuple(int(d) for d in reversed(tensor.shape))
    if kind == "F32" or kind == "F16":
        return {"weight": mx.array(np.asarray(tensor.data).reshape(shape))}
    if kind == "BF16":
        values = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        return {"weight": mx.array(values).astype(mx.bfloat16)}  # exact: bf16 -> f32 -> bf16
    rows = np.asarray(tensor.data).reshape(-1, tensor.data.shape[-1])  # rows of raw blocks
    step = max(1, _CHUNK_WEIGHTS // shape[-1])
    parts = [
        _quantized_rows(rows[i : i + step], tensor.tensor_type) for i in range(0, len(rows), step)
    ]
    lead = shape[:-1]
    return {
        name: mx.concatenate([part[name] for part in parts]).reshape(*lead, -1) for name in parts[0]
    }


def _quantized_rows(blocks: np.ndarray, qtype: Any) -> dict[str, Any]:
    import mlx.core as mx
    from gguf import dequantize

    kind, rows = qtype.name, blocks.shape[0]
    if kind == "MXFP4":
        return _mxfp4_rows(blocks.reshape(-1, _block_bytes(qtype)), rows)
    if kind in AFFINE_BITS:
        q, scale, bias = decode(blocks.reshape(-1, _block_bytes(qtype)), kind)
        weight = mx.array(pack(q.reshape(rows, -1), AFFINE_BITS[kind]))
        scales, biases = mx.array(scale.reshape(rows, -1)), mx.array(bias.reshape(rows, -1))
    elif kind == "Q6_K":
        q, scale, bias = q6_k_symmetric(blocks.reshape(-1, _block_bytes(qtype)))
        weight = mx.array(pack(q.reshape(rows, -1), 8))
        scales, biases = mx.array(scale.reshape(rows, -1)), mx.array(bias.reshape(rows, -1))
    else:
        values = mx.array(dequantize(blocks, qtype))
        weight, scales, biases = mx.quantize(values, group_size=GROUP_SIZE, bits=REQUANT_BITS[kind])
    out = {
        "weight": weight,
        "scales": scales.astype(mx.float16),
        "biases": biases.astype(mx.float16),
    }
    mx.eval(out)
    return out


def q6_k_symmetric(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K blocks (n, 210: 128 bytes of low nibbles, 64 of high bits, 16 int8 scales,
    float16 d) -> 8-bit integers (groups, 32), float16-exact scales and biases (groups,):
    per 32 weights the step a quarter of the larger sub-block's d x sc (with its sign),
    bias -128 x step (symmetric)."""
    from gguf import GGMLQuantizationType, dequantize

    values = dequantize(blocks, GGMLQuantizationType.Q6_K).reshape(-1, 32)
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = np.ascontiguousarray(blocks[:, 208:210]).view(np.float16).astype(np.float32)
    pairs = (d * sc).reshape(-1, 2)  # per 32: two 16-weight sub-blocks
    larger = np.take_along_axis(pairs, np.abs(pairs).argmax(axis=-1)[:, None], axis=-1)[:, 0]
    # its sign kept, so its integers 4 (q - 32) lie in -128..124, never clipped
    step = (larger / 4).astype(np.float16).astype(np.float32)
    safe = np.where(step != 0, step, 1.0)[:, None]
    k = np.clip(np.rint(values / safe), -128, 127)
    return (k + 128).astype(np.uint8), step, -128 * step


def _block_bytes(qtype: Any) -> int:
    from gguf import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[qtype][1]


def _mxfp4_rows(blocks: np.ndarray, rows: int) -> dict[str, Any]:
    """ggml's MXFP4 blocks (one exponent byte, 16 bytes of codes: the low nibbles are
    values 0-15, the high ones 16-31) as MLX's mxfp4 arrays: the same codes packed
    eight to a word, the exponents as the uint8 scales."""
    import mlx.core as mx

    codes = np.concatenate([blocks[:, 1:17] & 0x0F, blocks[:, 1:17] >> 4], axis=-1)
    out = {
        "weight": mx.array(pack(codes.reshape(rows, -1), 4)),
        "scales": mx.array(np.ascontiguousarray(blocks[:, 0]).reshape(rows, -1)),
    }
    mx.eval(out)
    return out
