"""GGUF block types MLX cannot load as stored (the K-quants, Q5_0 / Q5_1): decoded by
gguf-py, then re-quantized with `mx.quantize` to MLX affine at group size 32.

Each type gets two bits more than it stores (capped at MLX's 8), so the second
rounding's step is about a quarter of the file's own. Added error (RMS, relative to the
weights' RMS, random K blocks): Q4_K -> 6 bit 0.8% (4 bit: 2.4%), Q6_K -> 8 bit 0.44%
(6 bit: 1.75%), Q5_K -> 8 bit 0.2%, Q3_K -> 5 bit 3.5%, Q2_K -> 4 bit 4.9%. Q4_K costs
7 bits a weight (6 + a float16 scale and bias per 32) instead of 4.5, Q6_K 9 instead of
6.56; float16 would cost 16. In a file that needs this path,
the Q4_0 / Q4_1 / Q8_0 tensors go through it too (mx.load reads whole files only).

Memory stays bounded: one tensor at a time, dequantized in row chunks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# GGUF type -> MLX affine bits (group size GROUP_SIZE).
REQUANT_BITS: dict[str, int] = {
    "Q2_K": 4,
    "Q3_K": 5,
    "Q4_K": 6,
    "Q5_K": 8,
    "Q6_K": 8,
    "Q4_0": 6,
    "Q4_1": 6,
    "Q5_0": 8,
    "Q5_1": 8,
    "Q8_0": 8,
}
# Types only this path reads (mx.load refuses a file holding any of them).
NEEDS_REQUANT: tuple[str, ...] = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1")
GROUP_SIZE = 32
_CHUNK_VALUES = 1 << 24  # float32 values dequantized at once (64 MB)


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
    return _requantize(tensor, REQUANT_BITS[kind], shape)


def _requantize(tensor: Any, bits: int, shape: tuple[int, ...]) -> dict[str, Any]:
    import mlx.core as mx
    from gguf import dequantize

    blocks = np.asarray(tensor.data).reshape(-1, tensor.data.shape[-1])  # rows of blocks
    step = max(1, _CHUNK_VALUES // shape[-1])
    parts: list[tuple[Any, Any, Any]] = []
    for start in range(0, blocks.shape[0], step):
        values = dequantize(blocks[start : start + step], tensor.tensor_type)
        weight, scales, biases = mx.quantize(mx.array(values), group_size=GROUP_SIZE, bits=bits)
        parts.append((weight, scales.astype(mx.float16), biases.astype(mx.float16)))
        mx.eval(parts[-1])
    lead = shape[:-1]
    weight, scales, biases = (mx.concatenate([p[i] for p in parts]) for i in range(3))
    return {
        "weight": weight.reshape(*lead, -1),
        "scales": scales.reshape(*lead, -1),
        "biases": biases.reshape(*lead, -1),
    }
