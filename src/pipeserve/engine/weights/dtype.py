"""Which weight layout a model runs with (`options.dtype`), chosen at load time.

On the CPU, MLX's quantized matmul is slower than a float32 matmul through OpenBLAS
(SmolLM2-135M Q4_1 here: about 6 tok/s quantized, 11 tok/s as float32), so `auto` on
the CPU keeps quantized layers quantized only for pipeserve's native kernels
(engine/cpu_kernels, applied by the loader) and otherwise dequantizes them to float32;
on a GPU, where quantized kernels are the fast path, it keeps them. `quantized` keeps
whatever the folder stores (MLX's own layers); a float type casts every weight
(dequantizing first).
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_unflatten

DTYPES = ("float32", "float16", "bfloat16")  # options.dtype values that cast every weight
LAYOUTS = ("auto", "quantized", *DTYPES)


def is_quantized(model: nn.Module) -> bool:
    return any(_quantized(m) for _, m in model.named_modules())


def _quantized(module: nn.Module) -> bool:
    return isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding))


def target_dtype(layout: str, quantized: bool, on_cpu: bool) -> str | None:
    """The float type to run in, or None to keep the weights as loaded."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown dtype {layout!r}; use one of {', '.join(LAYOUTS)}")
    if layout in DTYPES:
        return layout
    if layout == "auto" and quantized and on_cpu:
        return "float32"
    return None


def dequantize(model: nn.Module, dtype: mx.Dtype) -> int:
    """Replace quantized linear / embedding layers by plain ones in `dtype`; returns how
    many. Dequantized in float32 (scales and biases widened first) so float32 weights
    are exactly scale * q + bias, then cast; one layer at a time to bound peak memory."""
    targets = [(name, m) for name, m in model.named_modules() if name and _quantized(m)]
    count = len(targets)
    while targets:
        name, module = targets.pop()
        plain = _plain_twin(module, dtype)
        mx.eval(plain.parameters())
        model.update_modules(tree_unflatten([(name, plain)]))
        del module, plain
    return count


def _plain_twin(module: nn.Module, dtype: mx.Dtype) -> nn.Module:
    weight = mx.dequantize(
        module.weight,
        module.scales.astype(mx.float32),
        None if module.get("biases") is None else module["biases"].astype(mx.float32),
        module.group_size,
        module.bits,
        module.mode,
    ).astype(dtype)
    out_dims, in_dims = weight.shape
    if isinstance(module, nn.QuantizedEmbedding):
        plain: nn.Module = nn.Embedding(out_dims, in_dims)
    else:
        plain = nn.Linear(in_dims, out_dims, bias="bias" in module)
        if "bias" in module:
            plain.bias = module.bias.astype(dtype)
    plain.weight = weight
    return plain
