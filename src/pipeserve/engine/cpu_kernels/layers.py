"""Layers that run through the native kernels: quantized linear and embedding layers
(the rest of the model in float32), and RMSNorm / RoPE as one op each.

`use_kernels(model, ext)` swaps each eligible `nn.QuantizedLinear` /
`nn.QuantizedEmbedding` (affine mode, 4 / 5 / 8 bits, a group size that is a multiple
of 32) for a twin holding the very same arrays: no copy, no float32 weights. An
embedding's lookups dequantize only the rows looked up (MLX's own op) and hand float32
on; its `as_linear` (a tied output projection) runs the kernel.

`use_fused_ops(model, ext)` swaps `nn.RMSNorm` and `nn.RoPE` (exact types: scaled RoPE
variants are other classes) for twins that run one kernel op on float32 inputs and
MLX's own op on anything else, and routes attention (decode steps, and prefills with a
causal or array mask) through one kernel op: mlx-lm's models call the module-level
`scaled_dot_product_attention` of their own module, which is wrapped there (once per
model module; anything else, attention sinks, a quantized cache, other masks, goes to
mlx-lm's function unchanged).

`use_dense_kernel(model, ext)` routes float32 linear layers, in either layout
(cpu_layout's transposed one or nn.Linear's), through `f32_matmul`: a few activation
rows (decode steps) read the weight once on the kernels' threads, more go to MLX's
matmul as before; both layouts compute the very same numbers. Embeddings and the output
projection are repacked into the kernel's panels and multiply every row count there
(an embedding whose table the model's code reads itself keeps its layout).
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from pipeserve.engine.cpu_kernels import BITS
from pipeserve.engine.cpu_kernels.transposed import TransposedEmbedding, TransposedLinear

QUANT_KEYS = ("scales", "biases")  # kept in their stored dtype (float16 for GGUF files)


class KernelLinear(nn.Module):
    """A quantized linear layer through `affine_qmm`. Symmetric blocks (a GGUF's Q8_0,
    Q5_0, Q4_0 projections: every bias -2^(bits - 1) x its scale) keep no biases, as
    `KernelEmbedding` does: the kernel computes each from its scale (the same numbers),
    so a decode step reads 1/9 (8 bits) to 1/12 (5 bits) fewer bytes of them."""

    def __init__(self, layer: nn.QuantizedLinear, ext: Any) -> None:
        super().__init__()
        self.weight, self.scales, self.biases = layer.weight, layer.scales, layer.biases
        if symmetric_zero(layer.scales, layer.biases, layer.bits) is not None:
            self.biases = mx.zeros((0,), dtype=layer.scales.dtype)  # affine_qmm: symmetric
        if "bias" in layer:
            self.bias = layer.bias
        self.group_size, self.bits = layer.group_size, layer.bits
        self._ext = ext

    @classmethod
    def of_arrays(cls, weight: mx.array, scales: mx.array, biases: mx.array,
                  bias: mx.array | None, group_size: int, bits: int, ext: Any) -> KernelLinear:  # fmt: skip
        """A kernel layer over these arrays (e.g. several layers' rows stacked)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.weight, layer.scales, layer.biases = weight, scales, biases
        if bias is not None:
            layer.bias = bias
        layer.group_size, layer.bits, layer._ext = group_size, bits, ext
        return layer

    def __call__(self, x: mx.array) -> mx.array:
        y: mx.array = self._ext.affine_qmm(
            x, self.weight, self.scales, self.biases, self.group_size, self.bits
        )
        return y + self.bias if "bias" in self else y


def symmetric_zero(scales: mx.array, biases: mx.array, bits: int) -> float | None:
    """-2^(bits - 1) where every bias is that times its scale (GGUF's Q8_0, Q4_0, Q5_0
    blocks: q * d - 2^(bits - 1) * d, exact in float16 as a power of two), else None."""
    zero = -(2 ** (bits - 1))
    return float(zero) if mx.array_equal(biases, scales * zero).item() else None


class KernelEmbedding(nn.Module):
    """A quantized embedding (and tied output projection). Symmetric blocks (a GGUF's
    Q8_0 embedding, Gemma 3's 262k x 640 one) keep no biases: the kernel computes each
    from its scale (the same numbers), so the output projection reads and holds 1/9 fewer
    bytes (10.5 MB on Gemma 3 270M)."""

    def __init__(self, layer: nn.QuantizedEmbedding, ext: Any) -> None:
        super().__init__()
        self.weight, self.scales, self.biases = layer.weight, layer.scales, layer.biases
        self.group_size, self.bits = layer.group_size, layer.bits
        self._zero = symmetric_zero(layer.scales, layer.biases, layer.bits)
        if self._zero is not None:
            self.biases = mx.zeros((0,), dtype=layer.scales.dtype)  # affine_qmm: symmetric
        self._ext = ext

    def __call__(self, ids: mx.array) -> mx.array:
        # float32 scales: a float16 dequantize would round every looked-up weight
        scales = self.scales[ids].astype(mx.float32)
        if self._zero is None:
            biases = self.biases[ids].astype(mx.float32)
        else:
            biases = scales * self._zero  # exact: a power of two
        return mx.dequantize(self.weight[ids], scales, biases, self.group_size, self.bits)

    def as_linear(self, x: mx.array) -> mx.array:
        y: mx.array = self._ext.affine_qmm(
            x, self.weight, self.scales, self.biases, self.group_size, self.bits
        )
        return y


class KernelRMSNorm(nn.Module):
    def __init__(self, layer: nn.RMSNorm, ext: Any) -> None:
        super().__init__()
        self.weight, self.eps = layer.weight, layer.eps
        self._ext = ext

    def __call__(self, x: mx.array) -> mx.array:
        if x.dtype != mx.float32 or self.weight.dtype != mx.float32:
            return mx.fast.rms_norm(x, self.weight, self.eps)
        y: mx.array = self._ext.rms_norm(x, self.weight, self.eps)
        return y


class KernelRoPE(nn.Module):
    def __init__(self, layer: nn.RoPE, ext: Any) -> None:
        super().__init__()
        self.dims, self.traditional = layer.dims, layer.traditional
        self.base, self.scale = layer.base, layer.scale
        self._ext = ext

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if x.dtype != mx.float32 or x.ndim != 4 or self.base is None:
            return mx.fast.rope(x, self.dims, traditional=self.traditional, base=self.base,
                                scale=self.scale, offset=offset)  # fmt: skip
        positions = mx.array([offset], dtype=mx.int32) if isinstance(offset, int) else offset
        y: mx.array = self._ext.rope(
            x, self.dims, self.traditional, self.base, self.scale, positions
        )
        return y


_FUSED: dict[type, type[nn.Module]] = {nn.RMSNorm: KernelRMSNorm, nn.RoPE: KernelRoPE}
SDPA_NAME = "scaled_dot_product_attention"


def kernel_attention(ext: Any, queries: mx.array, keys: mx.array, values: mx.array, cache: Any,
                     scale: float, mask: Any, merge_heads: bool = False) -> mx.array | None:  # fmt: skip
    """Attention as one kernel op (a decode step, or a prefill with mlx-lm's "causal"
    mask or a mask array), or None where it does not apply: a quantized cache, another
    mask kind, non-float32 inputs. On the CPU MLX's own runs as a fallback of many ops,
    6-8x slower at 45-512 query rows (measured here)."""
    causal = isinstance(mask, str) and mask == "causal"
    if (
        hasattr(cache, "bits")
        or not (mask is None or causal or isinstance(mask, mx.array))
        or not queries.dtype == keys.dtype == values.dtype == mx.float32
    ):
        return None
    array_mask = None if mask is None or causal else mask
    out: mx.array = ext.sdpa(queries, keys, values, scale, array_mask, merge_heads, causal)
    return out


def use_fused_ops(model: nn.Module, ext: Any) -> int:
    """Swap every `nn.RMSNorm` / `nn.RoPE` of `model` for its one-op twin and wrap the
    attention function of its mlx-lm modules; returns how many layers were swapped."""
    targets = [(name, m) for name, m in model.named_modules() if name and type(m) in _FUSED]
    for name, module in targets:
        model.update_modules(tree_unflatten([(name, _FUSED[type(module)](module, ext))]))
    for _, module in model.named_modules():
        _wrap_attention(sys.modules.get(type(module).__module__), ext)
    return len(targets)


def _wrap_attention(namespace: Any, ext: Any) -> None:
    original = getattr(namespace, SDPA_NAME, None)
    if original is None or getattr(original, "pipeserve_fused", False):
        return

    def attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any,
                  scale: float, mask: Any, sinks: Any = None) -> mx.array:  # fmt: skip
        if sinks is None:
            out = kernel_attention(ext, queries, keys, values, cache, scale, mask)
            if out is not None:
                return out
        return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

    attention.pipeserve_fused = True  # type: ignore[attr-defined]
    setattr(namespace, SDPA_NAME, attention)


_TWINS: dict[type, type[nn.Module]] = {
    nn.QuantizedLinear: KernelLinear,
    nn.QuantizedEmbedding: KernelEmbedding,
}


def eligible(module: nn.Module) -> bool:
    return (
        type(module) in _TWINS
        and getattr(module, "mode", "affine") == "affine"
        and module.bits in BITS
        and module.group_size % 32 == 0
        and module.get("biases") is not None
        and module.scales.dtype in (mx.float16, mx.float32)
    )


def use_kernels(model: nn.Module, ext: Any) -> int:
    """Swap every eligible quantized layer of `model` for its kernel twin; returns how
    many. Other quantized layers stay as they are (the caller dequantizes them)."""
    targets = [(name, m) for name, m in model.named_modules() if name and eligible(m)]
    for name, module in targets:
        twin = _TWINS[type(module)](module, ext)
        model.update_modules(tree_unflatten([(name, twin)]))
    return len(targets)


def cast_dense(model: nn.Module, dtype: mx.Dtype) -> None:
    """Cast every floating parameter to `dtype` except the kernel layers' scales and
    biases (the kernels read float16 directly: half the bytes)."""
    kernel_layers = {
        name for name, m in model.named_modules() if isinstance(m, (KernelLinear, KernelEmbedding))
    }
    updates = []
    for key, value in tree_flatten(model.parameters()):
        owner, _, leaf = key.rpartition(".")
        keep = owner in kernel_layers and leaf in QUANT_KEYS
        if not keep and mx.issubdtype(value.dtype, mx.floating) and value.dtype != dtype:
            updates.append((key, value.astype(dtype)))
    if updates:
        model.update(tree_unflatten(updates))


class DenseLinear(nn.Linear):
    """A float32 `nn.Linear` (same weight and bias) multiplying through `f32_matmul`."""

    def __init__(self, layer: nn.Linear, ext: Any) -> None:
        nn.Module.__init__(self)
        self.weight = layer.weight
        if "bias" in layer:
            self.bias = layer.bias
        self._ext = ext

    def __call__(self, x: mx.array) -> mx.array:
        bias = self.bias if "bias" in self else None
        y: mx.array = self._ext.f32_matmul(x, self.weight, False, bias)
        return y


class DenseTransposedLinear(TransposedLinear):
    """cpu_layout's transposed linear (same `weight_t`) multiplying through `f32_matmul`."""

    def __init__(self, layer: TransposedLinear, ext: Any) -> None:
        nn.Module.__init__(self)
        self.weight_t = layer.weight_t
        self._ext = ext

    def __call__(self, x: mx.array) -> mx.array:
        y: mx.array = self._ext.f32_matmul(x, self.weight_t, True)
        return y


class DenseEmbedding(nn.Embedding):
    """A float32 `nn.Embedding` whose tied output projection runs `f32_matmul` (for a
    model whose code reads the table itself; others hold it as `PanelEmbedding`)."""

    def __init__(self, layer: nn.Embedding, ext: Any) -> None:
        nn.Module.__init__(self)
        self.weight = layer.weight
        self._ext = ext

    def as_linear(self, x: mx.array) -> mx.array:
        y: mx.array = self._ext.f32_matmul(x, self.weight, False)
        return y


class DenseTransposedEmbedding(TransposedEmbedding):
    """cpu_layout's transposed embedding whose output projection runs `f32_matmul`."""

    def __init__(self, layer: TransposedEmbedding, ext: Any) -> None:
        nn.Module.__init__(self)
        self.weight_t = layer.weight_t
        self._ext = ext

    def as_linear(self, x: mx.array) -> mx.array:
        y: mx.array = self._ext.f32_matmul(x, self.weight_t, True)
        return y


class PanelTable(nn.Module):
    """A float32 matrix of `n` output columns held as `f32_panels`' contiguous panels
    (one copy), multiplying any number of rows through `f32_matmul_panels`, never the
    BLAS, which would pack the whole table again on every call."""

    def __init__(self, table: mx.array, transposed: bool, ext: Any) -> None:
        super().__init__()
        self.weight_panels = ext.f32_panels(table, transposed)
        self.n = int(table.shape[1] if transposed else table.shape[0])
        self._ext = ext

    @property
    def weight(self) -> mx.array:
        """The (n, K) matrix model code may read: lazy, so reading its shape costs nothing."""
        panels = self.weight_panels
        return panels.transpose(0, 2, 1).reshape(-1, panels.shape[1])[: self.n]

    def product(self, x: mx.array, bias: mx.array | None = None) -> mx.array:
        y: mx.array = self._ext.f32_matmul_panels(x, self.weight_panels, self.n, bias)
        return y


class PanelEmbedding(PanelTable):
    """A float32 embedding as panels: lookups gather each id's column of its panel, and
    the tied output projection (`as_linear`, the largest matmul of a small float32
    model) streams the panels."""

    def __call__(self, ids: mx.array) -> mx.array:
        width = self.weight_panels.shape[2]
        return self.weight_panels[ids // width, :, ids % width]

    def as_linear(self, x: mx.array) -> mx.array:
        return self.product(x)


class PanelLinear(PanelTable):
    """A float32 output projection (`lm_head`) as panels, its bias kept."""

    def __init__(self, weight: mx.array, transposed: bool, bias: mx.array | None,
                 ext: Any) -> None:  # fmt: skip
        super().__init__(weight, transposed, ext)
        if bias is not None:
            self.bias = bias

    def __call__(self, x: mx.array) -> mx.array:
        return self.product(x, self.bias if "bias" in self else None)


def _panel_twin(module: nn.Module, ext: Any) -> nn.Module:
    transposed = isinstance(module, (TransposedEmbedding, TransposedLinear))
    table: mx.array = module.weight_t if transposed else module.weight
    if isinstance(module, (nn.Embedding, TransposedEmbedding)):
        return PanelEmbedding(table, transposed, ext)
    return PanelLinear(table, transposed, module.bias if "bias" in module else None, ext)


_DENSE: dict[type, type[nn.Module]] = {
    nn.Linear: DenseLinear,
    nn.Embedding: DenseEmbedding,
    TransposedLinear: DenseTransposedLinear,
    TransposedEmbedding: DenseTransposedEmbedding,
}


def _dense_float32(module: nn.Module) -> bool:
    if type(module) not in _DENSE:  # exact types: quantized and other layers are other classes
        return False
    weights = [v for k, v in module.items() if k in ("weight", "weight_t", "bias")]
    return all(isinstance(v, mx.array) and v.dtype == mx.float32 for v in weights)


def _is_head(name: str, module: nn.Module, tables_read: bool) -> bool:
    """mlx-lm's `lm_head`, and embeddings (their `as_linear` is a tied output projection)
    unless the model's code reads their table (`tables_read`)."""
    if isinstance(module, (nn.Embedding, TransposedEmbedding)):
        return not tables_read
    return name.rpartition(".")[2] == "lm_head"


@functools.cache
def _module_reads_tables(module_name: str) -> bool:
    """Whether a model module's code reads `<...>.embed_tokens.weight` as an attribute
    (seed_oss, llama4_text and minicpm multiply by its transpose; gemma4_text takes its
    norms), which a panel table would rebuild on every call. Sanitizers' string keys do
    not count; a module whose source cannot be read counts as reading them."""
    try:
        tree = ast.parse(inspect.getsource(sys.modules[module_name]))
    except (KeyError, OSError, TypeError, SyntaxError):
        return True
    return any(
        isinstance(node, ast.Attribute) and node.attr == "weight"
        and isinstance(node.value, ast.Attribute) and node.value.attr == "embed_tokens"
        for node in ast.walk(tree)
    )  # fmt: skip


def use_dense_kernel(model: nn.Module, ext: Any) -> int:
    """Swap every float32 linear / embedding of `model` (either layout) for its twin that
    multiplies through the kernel; returns how many. Embeddings and the output projection
    are held as panels (`PanelEmbedding`, `PanelLinear`: any number of rows), the other
    linears keep their arrays (`f32_matmul`: a few rows). Run after cpu_layout's
    transpose. One matrix at a time is repacked and evaluated (the peak extra memory is
    the largest one)."""
    targets = [(name, m) for name, m in model.named_modules() if name and _dense_float32(m)]
    tables_read = _module_reads_tables(type(model).__module__)
    count = len(targets)
    while targets:  # popped, so each repacked matrix is freed as we go
        name, module = targets.pop()
        if _is_head(name, module, tables_read):
            twin = _panel_twin(module, ext)
            mx.eval(twin.parameters())
        else:
            twin = _DENSE[type(module)](module, ext)
        model.update_modules(tree_unflatten([(name, twin)]))
        del module, twin
    return count
