"""Where a one-op layer step (`ext.DecoderLayer`) writes its new keys and values in
mlx-lm's caches, and the cache's own bookkeeping after it.

`decode_step` answers, for one layer call, whether the layer op takes it and how: the
buffer position the first new token is written at, the RoPE positions, the mask as the
op takes it and, for a sliding window's ring buffer, how many buffer positions the token
attends to. `advance` then moves the cache's offsets as its own `update_and_fetch` would.

- `KVCache` / `BatchKVCache` (left-padded rows): 1..max_tokens tokens written at the
  cache's index, each attending to the positions before it.
- `RotatingKVCache` / `BatchRotatingKVCache` (a sliding window, e.g. Gemma 3's local
  layers): one token, written where mlx-lm's `_update_in_place` writes it (wrapping to
  the buffer's start once it is full), attending to every position the cache returns;
  the window is the buffer (its size is the window) plus the mask mlx-lm made for it.
  With `room`, also several tokens (a prompt chunk) while the ring has not wrapped and
  they fit in the window: the buffer is then linear (position i holds token i), as
  mlx-lm's `_update_concat` leaves it, so they are written at the cache's index with
  mlx-lm's mask.

- `QuantizedKVCache` (mlx-lm's, and engine/kv's `QuantizedRowCache`) /
  `BatchQuantizedKVCache` (`options.kv_cache`): as KVCache / BatchKVCache for decode
  steps in a buffer with room (prompts and growth: the cache's own update); the op
  (`DecoderLayer.quantized`) quantizes the new rows into the cache's (words, scales,
  biases) triples and reads the codes in its attention. float32 scales only.
  A step's `quantized` says which of the op's two calls takes it.

`room` (kv heads, head dim): the caller lets the step make room first, as the cache's own
update would (a prompt's first buffer, a buffer that must grow: mlx-lm's zeros appended
in its steps of 256 positions), so that prompts and the step after them take the op too.
Without it those take the cache's own update (the layer's per-op path), as does anything
else: a buffer that must be trimmed first (the step after that takes the op again),
several tokens on a ring past its window or after it wrapped, a ring that keeps its first
tokens, float16 caches.
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
# A quantized cache takes the op for decode steps and speculative checks (the widths its
# tests cover, ext.DECODER_LAYER_MAX_TOKENS); prompt chunks take MLX's quantized SDPA.
QUANTIZED_MAX_TOKENS = 16


@dataclass(frozen=True)
class CacheStep:
    index: int  # the buffer position of the first new token
    positions: mx.array | None  # RoPE positions of each row's first new token (None: index)
    mask: mx.array | None  # the mask as the layer op takes it
    seen: int = -1  # a ring buffer: the positions 0..seen - 1 attended (-1: index + l + 1)
    quantized: bool = False  # the cache holds (words, scales, biases): DecoderLayer.quantized


def decode_step(x: mx.array, mask: Any, cache: Any, max_tokens: int,
                room: tuple[int, int] | None = None) -> CacheStep | None:  # fmt: skip
    """The step the layer op takes for this call, or None (the per-op path). A ring
    buffer's wrap, and with `room` (kv heads, head dim) a buffer's growth, are applied
    here (as mlx-lm's update would): call the op after it."""
    tokens, kind = x.shape[1], type(cache)
    if not 1 <= tokens <= max_tokens or x.dtype != mx.float32:
        return None
    if kind in ONE_ROW_QUANTIZED or kind is BatchQuantizedKVCache:
        if cache.keys is None or tokens > QUANTIZED_MAX_TOKENS:
            return None
        return _quantized_step(mask, cache, tokens)
    linear = kind is KVCache or kind is BatchKVCache
    ring = kind is RotatingKVCache or kind is BatchRotatingKVCache
    if not (linear or ring):
        return None  # other caches take their own update
    if (cache.keys is None and room is None) or (
        cache.keys is not None and cache.keys.dtype != mx.float32
    ):
        return None
    shape = None if room is None else (x.shape[0], *room)
    if linear:
        return _linear_step(mask, cache, tokens, shape)
    if tokens == 1:
        return _ring_step(mask, cache, shape)
    return None if shape is None else _ring_prompt_step(mask, cache, tokens, shape)


Shape = tuple[int, int, int]  # (B, kv heads, head dim) of a buffer the step may make


def _zeros(shape: Shape, positions: int) -> mx.array:
    batch, heads, dim = shape
    return mx.zeros((batch, heads, positions, dim), mx.float32)


def _append(cache: Any, shape: Shape, positions: int) -> None:
    """`positions` zero positions after the buffers (new buffers where there are none)."""
    if cache.keys is None:
        cache.keys, cache.values = _zeros(shape, positions), _zeros(shape, positions)
        return
    cache.keys = mx.concatenate([cache.keys, _zeros(shape, positions)], axis=2)
    cache.values = mx.concatenate([cache.values, _zeros(shape, positions)], axis=2)


def _linear_step(mask: Any, cache: Any, tokens: int, shape: Shape | None) -> CacheStep | None:
    plain = type(cache) is KVCache
    index, positions = (cache.offset, None) if plain else (cache._idx, cache.offset)
    layer_mask = step_mask(mask, tokens, index + tokens, plain)
    if layer_mask is False:
        return None
    if cache.keys is None or index + tokens > cache.keys.shape[2]:
        if shape is None:
            return None  # too small: the cache's own update grows it
        if cache.keys is not None and index % cache.step != 0:  # as KVCache's update
            cache.keys, cache.values = cache.keys[..., :index, :], cache.values[..., :index, :]
        _append(cache, shape, (cache.step + tokens - 1) // cache.step * cache.step)
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


def _ring_written(cache: Any) -> tuple[bool, int]:
    """(a batch ring, tokens written so far), or (_, -1): mlx-lm's special cases (rows
    right-padded until `finalize`, a ring that keeps its first tokens)."""
    batch = type(cache) is BatchRotatingKVCache
    pending = cache._lengths is not None if batch else cache.keep != 0
    return batch, -1 if pending else (cache._offset if batch else cache.offset)


def _ring_step(mask: Any, cache: Any, shape: Shape | None) -> CacheStep | None:
    batch, written = _ring_written(cache)
    if written < 0:
        return None
    size = 0 if cache.keys is None else cache.keys.shape[2]
    if written >= size and size < cache.max_size:  # mlx-lm's _update_in_place grows it
        if shape is None:
            return None
        _append(cache, shape, min(cache.step, cache.max_size - written))
        cache._idx, size = written, cache.keys.shape[2]
    if size > cache.max_size:
        return None  # the cache's own update trims the buffer first
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


def _ring_prompt_step(mask: Any, cache: Any, tokens: int, shape: Shape) -> CacheStep | None:
    """Several tokens on a ring that has not wrapped, all within the window: a linear
    buffer (mlx-lm's mask is its causal one, with the rows' left padding)."""
    batch, written = _ring_written(cache)
    linear = not (batch and cache.rotated) and cache._idx == written
    if written < 0 or not linear or written + tokens > cache.max_size:
        return None
    layer_mask = step_mask(mask, tokens, written + tokens, not batch)
    if layer_mask is False:
        return None
    size = 0 if cache.keys is None else cache.keys.shape[2]
    if size < written + tokens:  # grown in mlx-lm's steps, never past the window
        steps = (written + tokens - size + cache.step - 1) // cache.step
        _append(cache, shape, min(steps * cache.step, cache.max_size - size))
    positions = cache.offset if batch else mx.array([cache.offset], mx.int32)
    return CacheStep(written, positions, layer_mask)


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
