"""A quantized KV cache for the decoding batch (`options.kv_cache: {bits, group_size}`).

mlx-lm 0.32 has a quantized cache for one sequence (`QuantizedKVCache`: keys and values
each stored as MLX's affine triple, packed uint32 words + per-group scales + biases) and
an attention that reads it (`quantized_scaled_dot_product_attention`, two
`mx.quantized_matmul`s), chosen by every mlx-lm attention when the cache has `bits`. Its
batched generator has no quantized batch cache: `BatchQuantizedKVCache` here is
mlx-lm's `BatchKVCache` (rows left-padded to one shared end; offset = index - left
padding) over those triples, with every operation the batch, the prefix cache,
speculation and prompt groups use: update, prepare / finalize (right-padded prefill),
trim, filter, extend, extract (a `QuantizedRowCache`), merge (of row caches), roll.

A row's cache outside the batch (a prefix-cache entry, a prompt group's copy, a new
row's empty cache) is a `QuantizedRowCache`: mlx-lm's QuantizedKVCache that merges
into a batch. On the CPU kernels, a fused layer's decode steps over either cache are one
op that writes and reads the triples directly (`DecoderLayer.quantized`,
cpu_kernels/cache_steps.py); prompts and other layers use mlx-lm's quantized attention
over the same rows (docs/cpu-kernels.md "Quantized KV cache").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    _BaseCache,
    dynamic_roll,
    make_prompt_cache,
)

from pipeserve.config.models import KvCacheOptions
from pipeserve.errors import LoadRefused

Parts = tuple[mx.array, ...]  # (packed words, scales, biases)


def _each(fn: Callable[[mx.array], mx.array], parts: Parts) -> Parts:
    return tuple(fn(p) for p in parts)


class QuantizedRowCache(QuantizedKVCache):
    """One row's quantized cache (mlx-lm's) that joins a batch as a BatchQuantizedKVCache."""

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedKVCache:
        return BatchQuantizedKVCache.merge(caches)

    def size(self) -> int:
        return int(self.offset)


class BatchQuantizedKVCache(_BaseCache):
    step = 256

    def __init__(self, left_padding: list[int], group_size: int, bits: int) -> None:
        self.keys: Parts | None = None
        self.values: Parts | None = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0
        self._right_padding: mx.array | None = None
        self.group_size, self.bits = group_size, bits

    def _empty(self, like: mx.array, rows: int, steps: int) -> Parts:
        heads, dim = like.shape[1], like.shape[3]
        shape = (rows, heads, steps)
        return (
            mx.zeros((*shape, dim * self.bits // 32), dtype=mx.uint32),
            mx.zeros((*shape, dim // self.group_size), dtype=like.dtype),
            mx.zeros((*shape, dim // self.group_size), dtype=like.dtype),
        )

    def _quantize(self, x: mx.array) -> Parts:
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Parts, Parts]:
        prev, count = self._idx, keys.shape[2]
        if self.keys is None or self.values is None or prev + count > self.keys[0].shape[2]:
            steps = (self.step + count - 1) // self.step * self.step
            new_k = self._empty(keys, keys.shape[0], steps)
            new_v = self._empty(values, values.shape[0], steps)
            if self.keys is not None and self.values is not None:
                self.keys = tuple(
                    mx.concatenate([old[..., :prev, :], new], axis=2)
                    for old, new in zip(self.keys, new_k)
                )
                self.values = tuple(
                    mx.concatenate([old[..., :prev, :], new], axis=2)
                    for old, new in zip(self.values, new_v)
                )
            else:
                self.keys, self.values = new_k, new_v
        self.offset = self.offset + count
        self._idx += count
        for buffer, new in zip(self.keys, self._quantize(keys)):
            buffer[..., prev : self._idx, :] = new
        for buffer, new in zip(self.values, self._quantize(values)):
            buffer[..., prev : self._idx, :] = new
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Parts, Parts]:
        assert self.keys is not None and self.values is not None
        end = self._idx
        return _each(lambda p: p[..., :end, :], self.keys), _each(
            lambda p: p[..., :end, :], self.values
        )

    def prepare(self, *, left_padding: list[int] | None = None, lengths: Any = None,
                right_padding: list[int] | None = None) -> None:  # fmt: skip
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("Left padding can only be added to an empty cache")
            padding = mx.array(left_padding)
            self.left_padding = self.left_padding + padding
            self.offset = self.offset - padding
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self) -> None:
        if self._right_padding is not None:
            self.roll(self._right_padding)
            self._right_padding = None

    def roll(self, by: mx.array) -> None:
        """Row i's positions move right by by[i] (its left padding grows by as much)."""
        if self.keys is not None and self.values is not None:
            self.keys = _each(lambda p: dynamic_roll(p, by[:, None], axis=2), self.keys)
            self.values = _each(lambda p: dynamic_roll(p, by[:, None], axis=2), self.values)
        self.offset = self.offset - by
        self.left_padding = self.left_padding + by

    @property
    def state(self) -> Any:
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: Any) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def filter(self, batch_indices: list[int]) -> None:
        """Keep rows `batch_indices`, their common left padding dropped."""
        every_row: list[int] = self.left_padding.tolist()
        shift = min(every_row[i] for i in batch_indices)
        rows = mx.array(batch_indices)
        if self.keys is not None and self.values is not None:
            self.keys = _each(lambda p: p[rows][..., shift:, :], self.keys)
            self.values = _each(lambda p: p[rows][..., shift:, :], self.values)
        self.offset = self.offset[rows]
        self.left_padding = self.left_padding[rows] - shift
        self._idx -= shift

    def extend(self, other: BatchQuantizedKVCache) -> None:
        """Append `other`'s rows, both right-justified to one shared end."""
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        like = self if self.keys is not None else other
        assert like.keys is not None and like.values is not None
        end = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        padded = [self._padded(c, like.keys, like.values, end, size) for c in (self, other)]
        self.keys = tuple(mx.concatenate([a, b]) for a, b in zip(padded[0][0], padded[1][0]))
        self.values = tuple(mx.concatenate([a, b]) for a, b in zip(padded[0][1], padded[1][1]))
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate(
            [self.left_padding + end - self._idx, other.left_padding + end - other._idx]
        )
        self._idx = end

    @staticmethod
    def _padded(c: BatchQuantizedKVCache, keys: Parts, values: Parts, end: int,
                size: int) -> tuple[Parts, Parts]:  # fmt: skip
        rows = c.offset.shape[0]
        left = end - c._idx

        def pad(p: mx.array | None, like: mx.array) -> mx.array:
            if p is None:
                p = mx.zeros((rows, like.shape[1], 0, like.shape[3]), dtype=like.dtype)
            right = size - p.shape[2] - left
            if right < 0:
                p, right = p[..., :right, :], 0
            if left or right:
                p = mx.pad(p, [(0, 0), (0, 0), (left, right), (0, 0)])
            return p

        k = c.keys or (None, None, None)
        v = c.values or (None, None, None)
        return (
            tuple(pad(p, like) for p, like in zip(k, keys)),
            tuple(pad(p, like) for p, like in zip(v, values)),
        )

    def extract(self, idx: int) -> QuantizedRowCache:
        out = QuantizedRowCache(group_size=self.group_size, bits=self.bits)
        row: Any = out  # mlx-lm's attributes are typed None
        if self.keys is None or self.values is None:
            return out
        start: int = self.left_padding.tolist()[idx]
        end = self._idx
        row.keys = _each(lambda p: mx.contiguous(p[idx : idx + 1, :, start:end]), self.keys)
        row.values = _each(lambda p: mx.contiguous(p[idx : idx + 1, :, start:end]), self.values)
        row.offset = end - start
        return out

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedKVCache:
        """One batch of row caches (QuantizedKVCache), right-justified."""
        first = caches[0]
        lengths = [c.offset if c.keys is not None else 0 for c in caches]
        longest = max(lengths)
        batch = cls([longest - n for n in lengths], first.group_size, first.bits)
        if longest == 0:
            return batch
        keys = next(c.keys for c in caches if c.keys is not None)
        values = next(c.values for c in caches if c.values is not None)

        def zeros(like: mx.array) -> mx.array:
            shape = (len(caches), like.shape[1], longest, like.shape[3])
            return mx.zeros(shape, dtype=like.dtype)

        batch.keys = _each(zeros, keys)
        batch.values = _each(zeros, values)
        for i, (n, c) in enumerate(zip(lengths, caches)):
            if n == 0:
                continue
            start = longest - n
            for mine, theirs in zip(batch.keys, c.keys):
                mine[i : i + 1, :, start:] = theirs[..., :n, :]
            for mine, theirs in zip(batch.values, c.values):
                mine[i : i + 1, :, start:] = theirs[..., :n, :]
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return sum(p.nbytes for p in (*self.keys, *self.values))


class RowCaches:
    """Makes a new row's per-layer caches: the model's own, with every plain KVCache
    quantized as `options` says (or None: mlx-lm's default caches)."""

    def __init__(self, model: Any, options: KvCacheOptions | None) -> None:
        self.model, self.options = model, options
        if options is None:
            return
        caches = self()
        if not any(type(c) is QuantizedRowCache for c in caches or []):
            raise LoadRefused("options.kv_cache: this model has no plain KV cache to quantize")
        try:  # one token through every layer: head sizes, attention sinks, cache kinds
            mx.eval(model(mx.array([[0]]), cache=caches))
        except (ValueError, TypeError) as error:
            raise LoadRefused(
                f"options.kv_cache (bits {options.bits}, group_size {options.group_size}):"
                f" this model cannot keep its KV cache quantized: {error}"
            ) from error

    def __call__(self) -> list[Any] | None:
        options = self.options
        if options is None:
            return None
        return [
            QuantizedRowCache(group_size=options.group_size, bits=options.bits)
            if type(c) is KVCache
            else c
            for c in make_prompt_cache(self.model)
        ]
