"""Dense float32 weights stored K x N for the CPU's BLAS (`options.cpu_pretranspose`).

mlx-lm's `nn.Linear` keeps its weight N x K and multiplies `x @ weight.T`; on the CPU
that is an sgemm with a transposed operand, which OpenBLAS packs on every call. With
the weight stored transposed once at load time the same product is a plain `x @ w`:
bit-identical results (same kernel, same summation order over K), measured here on a
116M-parameter Qwen3 at batch 1 / 8: a decode step 73 -> 51 ms and 87 -> 66 ms, the
151k-row output projection alone 45 -> 24 ms. float16 / bfloat16 and quantized layers
gain nothing on the CPU (float16 got slower) and are left alone, as is every layer
on a GPU, whose kernels prefer the N x K layout. Layers with a bias are left alone too:
a fused `addmm` rounds differently per layout in some BLAS builds (the reference BLAS
MLX bundles), and equal outputs are the point.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

log = logging.getLogger("pipeserve.engine")

TRANSPOSE_ROWS = 512  # rows per tile: 2x faster than one strided copy of a 151k-row table


def transposed(weight: mx.array) -> mx.array:
    """`weight.T` as a contiguous array, copied in row tiles that stay in cache."""
    if weight.shape[0] <= TRANSPOSE_ROWS:
        return mx.contiguous(weight.T)
    tiles = [
        mx.contiguous(weight[i : i + TRANSPOSE_ROWS].T)
        for i in range(0, weight.shape[0], TRANSPOSE_ROWS)
    ]
    return mx.concatenate(tiles, axis=1)


class TransposedLinear(nn.Module):
    """A bias-free `nn.Linear` with its weight held K x N (`weight_t`); same outputs."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight_t = transposed(linear.weight)

    @property
    def weight(self) -> mx.array:
        """The N x K view model code may read (a free transpose)."""
        return self.weight_t.T

    def __call__(self, x: mx.array) -> mx.array:
        return x @ self.weight_t


class TransposedEmbedding(nn.Module):
    """`nn.Embedding` held vocab-transposed: lookups gather columns (a few per step), and
    the tied output projection (`as_linear`, the largest matmul of a small model) runs
    without a transposed operand. One copy of the table, not two."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.weight_t = transposed(embedding.weight)

    @property
    def weight(self) -> mx.array:
        return self.weight_t.T

    def __call__(self, ids: mx.array) -> mx.array:
        return mx.moveaxis(mx.take(self.weight_t, ids, axis=1), 0, -1)

    def as_linear(self, x: mx.array) -> mx.array:
        return x @ self.weight_t


_REPLACEMENTS: dict[type, type[nn.Module]] = {
    nn.Linear: TransposedLinear,
    nn.Embedding: TransposedEmbedding,
}


def applies_here() -> bool:
    """Only the CPU device benefits."""
    return bool(mx.default_device() == mx.cpu)


def _eligible(module: nn.Module) -> bool:
    # Exact types: quantized and expert layers are other classes.
    return (
        type(module) in _REPLACEMENTS and "bias" not in module and module.weight.dtype == mx.float32
    )


def pretranspose_dense_weights(model: nn.Module) -> int:
    """Swap every bias-free float32 `nn.Linear` / `nn.Embedding` of `model` for its
    transposed twin; returns how many.

    One matrix at a time is copied and evaluated, so the peak extra memory is the
    largest single matrix, not the model.
    """
    targets = [
        (name, module) for name, module in model.named_modules() if name and _eligible(module)
    ]
    count = len(targets)
    while targets:  # popped, so each replaced matrix is freed as we go
        name, module = targets.pop()
        twin = _REPLACEMENTS[type(module)](module)
        mx.eval(twin.parameters())
        model.update_modules(tree_unflatten([(name, twin)]))
        del module, twin
    return count
