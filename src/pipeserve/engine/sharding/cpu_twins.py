"""Transposed twins of mlx's tensor-sharded linears for cpu_layout (`cpu_pretranspose`).

`Model.shard` swaps `nn.Linear` for `AllToShardedLinear` / `ShardedToAllLinear`, which
cpu_layout does not know, so after tensor sharding only the embedding would be stored
transposed. These twins hold the local slice K x N and compute the same products (the
same all_sum for ShardedToAll); like cpu_layout they take bias-free float32 layers only.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.nn.layers.distributed import AllToShardedLinear, ShardedToAllLinear

from pipeserve.engine.cpu_kernels import transposed


class TransposedAllToSharded(nn.Module):
    def __init__(self, linear: AllToShardedLinear) -> None:
        super().__init__()
        self.weight_t = transposed.transposed(linear.weight)

    @property
    def weight(self) -> mx.array:
        return self.weight_t.T

    def __call__(self, x: mx.array) -> mx.array:
        return x @ self.weight_t


class TransposedShardedToAll(nn.Module):
    def __init__(self, linear: ShardedToAllLinear) -> None:
        super().__init__()
        self.weight_t = transposed.transposed(linear.weight)
        self.group: Any = linear.group

    @property
    def weight(self) -> mx.array:
        return self.weight_t.T

    def __call__(self, x: mx.array) -> mx.array:
        return mx.distributed.all_sum(x @ self.weight_t, group=self.group)


def register() -> None:
    """Let transposed.pretranspose_dense_weights swap the sharded linears too."""
    transposed._REPLACEMENTS.setdefault(AllToShardedLinear, TransposedAllToSharded)
    transposed._REPLACEMENTS.setdefault(ShardedToAllLinear, TransposedShardedToAll)
