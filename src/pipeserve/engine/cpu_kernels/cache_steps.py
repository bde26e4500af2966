"""Where a one-op decode step (`ext.DecoderLayer`) writes its new keys and values in
mlx-lm's caches, and the cache's own bookkeeping after it.

`decode_step` answers, for one layer call, whether the layer op takes it and how: the
buffer position the first new token is written at, the RoPE positions, the mask as the
op takes it and, for a sliding window's ring buffer, how many buffer positions the token
attends to. `advance` then moves the cache's offsets as its own `update_and_fetch` would.

- `KVCache` / `BatchKVCache` (left-padded rows): 1..max_tokens tokens written at the
  cache's index, each attending to the positions before it.
- `QuantizedKVCache` (mlx-lm's, and engine/kv's `QuantizedRowCache`) /
  `BatchQuantizedKVCache` (`options.kv_cache`): as KVCache / BatchKVCache; the op
  (`DecoderLayer.quantized`) quantizes the new rows into the cache's (words, scales,
  biases) triples and reads the codes in its attention. float32 scales only.
- `RotatingKVCache` / `BatchRotatingKVCache` (a sliding window, e.g. Gemma 3's local
  layers): one token, written where mlx-lm's `_update_in_place` writes it (wrapping to
  the buffer's start once it is full), attending to every position the cache returns;
  the window is the buffer (its size is the window) plus the mask mlx-lm made for it.

Anything else takes the cache's own update (the layer's per-op path): no buffer yet, a
buffer that must grow or be trimmed first (the step after that takes the op again),
several tokens on a ring, a ring that keeps its first tokens, float16 caches.
A step's `quantized` says which of the op's two calls takes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    BatchKVCache,
    BatchRotatingKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from pipeserve.engine.kv.quantized import BatchQuantizedKVCache, QuantizedRowCache

ONE_ROW_QUANTIZED = (QuantizedKVCache, QuantizedRowCache)


@dataclass(frozen=True)
class CacheStep:
    index: int  # the buffer position of the first new token
    positions: mx.array | None  # RoPE positions of each row's first new token (None: index)
    mask: mx.array | None  # the mask as the layer op takes it
    seen: int = -1  # a ring buffer: the positions 0..seen - 1 attended (-1: index + l + 1)
    quantized: bool = False  # the cache holds (words, scales, biases): DecoderLayer.quantized


def decode_step(x: mx.array, mask: Any, cache: Any, max_tokens: int) -> CacheStep | None:
    """The step the layer op takes for this call, or None (the per-op path). A ring
    buffer's wrap is applied here (as mlx-lm's update would): call the op after it."""
    tokens = x.shape[1]
    if not 1 <= tokens <= max_tokens or x.dtype != mx.float32:
        return None
    keys = getattr(cache, "keys", None)
    if keys is None:
        return None
    kind = type(cache)
    if kind in ONE_ROW_QUANTIZED or kind is BatchQuantizedKVCache:
        return _quantized_step(mask, cache, tokens)
    if keys.dtype != mx.float32:
        return None
    if kind is KVCache or kind is BatchKVCache:
        return _linear_step(mask, cache, tokens)
    if kind is RotatingKVCache or kind is BatchRotatingKVCache:
        return _ring_step(mask, cache, tokens)
    return None


def _linear_step(mask: Any, cache: Any, tokens: int) -> CacheStep | None:
    plain = type(cache) is KVCache
    index, positions = (cache.offset, None) if plain else (cache._idx, cache.offset)
    if index + tokens > cache.keys.shape[2]:
        return None  # too small: the cache's own update grows it
    layer_mask = step_mask(mask, tokens, index + tokens, plain)
    if layer_mask is False:
        return None
    return CacheStep(index, positions, layer_mask)


def _quantized_step(mask: Any, cache: Any, tokens: int) -> CacheStep | None:
    keys, values = cache.keys, cache.values
    if any(part.dtype != mx.float32 for part in (*keys[1:], *values[1:])):
        return None  # float16 scales: the cache's own update
    plain = type(cache) is not BatchQuantizedKVCache
    index, positions = (cache.offset, None) if plain else (cache._idx, cache.offset)
    if index + tokens > keys[0].shape[2]:
        return None
    layer_mask = step_mask(mask, tokens, index + tokens, plain)
    if layer_mask is False:
        return None
    return CacheStep(index, positions, layer_mask, quantized=True)


def _ring_step(mask: Any, cache: Any, tokens: int) -> CacheStep | None:
    batch = type(cache) is BatchRotatingKVCache
    pending = cache._lengths is not None if batch else cache.keep != 0  # mlx-lm's special cases
    if tokens != 1 or pending:
        return None
    size, written = cache.keys.shape[2], cache._offset if batch else cache.offset
    if size > cache.max_size or (written >= size and size < cache.max_size):
        return None  # the cache's own update trims or grows the buffer first
    seen = min(written + 1, size)
    layer_mask = step_mask(mask, 1, seen, not batch)
    if layer_mask is False:
        return None
    if cache._idx == cache.max_size:  # full: wrap to the start, as _update_in_place does
        cache._idx = 0
        if batch:
            cache.rotated = True
    if batch and cache.rotated:
        cache.left_padding = cache.left_padding - 1
    positions = cache.offset if batch else mx.array([cache.offset], mx.int32)
    return CacheStep(cache._idx, positions, layer_mask, seen)


def advance(cache: Any, tokens: int) -> None:
    """The offsets after `tokens` new tokens, as the cache's own update moves them."""
    kind = type(cache)
    if kind is KVCache or kind in ONE_ROW_QUANTIZED:
        cache.offset += tokens
        return
    if kind is RotatingKVCache:
        cache.offset += tokens
    else:
        cache.offset = cache.offset + tokens
    if kind is BatchRotatingKVCache:
        cache._offset += tokens
    cache._idx += tokens


def step_mask(mask: Any, tokens: int, keys: int, plain_cache: bool) -> mx.array | None | bool:
    """The mask the layer op takes (its new tokens see each other causally; a mask adds
    to that), or False: one it does not. mlx-lm passes None (one token), "causal" (a
    KVCache's few tokens), or an array (B, 1, L, S) (BatchKVCache: left padding) or (L, S)."""
    if mask is None:
        return None if tokens == 1 else False  # several tokens, no mask: not causal
    if isinstance(mask, str):
        return None if mask == "causal" and plain_cache else False
    if not isinstance(mask, mx.array) or mask.dtype not in (mx.bool_, mx.float32):
        return False
    if mask.ndim == 2:
        mask = mask.reshape(1, 1, *mask.shape)
    if mask.ndim != 4 or mask.shape[2:] != (tokens, keys):
        return False
    return mask
