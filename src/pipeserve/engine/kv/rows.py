"""A decoding batch's KV cache rows: keep some when rows finish, copy one row out, forget
the last positions of each row (trim_rows, for speculation's rollback and the draft), and
move a right-padded prefill's rows to the right (kernel_finalize).

mlx-lm's BatchKVCache.filter and extract (0.32) do it one layer at a time, and both read
the left padding back from the device (`tolist`, `mx.eval`): that waits for the decode
step in flight, so the next one is queued only after it ends. They also queue one gather
per buffer (filter: the whole capacity) and two ops per buffer per extract, and MLX's
CPU scheduler holds the engine thread while more than a few dozen ops are in flight:
with a step already queued, a finish's 120-180 small ops wait for it too. A staggered
batch (rows ending at different steps, as real traffic does) paid ~20-30 ms per finish.

Here (same results as mlx-lm's, token for token):
- the left padding is read from the batch's previous, long evaluated array, and the new
  left padding and offsets (offset = index - left padding, an invariant of every
  BatchKVCache operation) are built from Python ints: nothing waits;
- on the CPU with the kernels (`ext.cache_rows`), every layer's keys and values are done
  by ONE op: the finished row's used positions copied out (queued at once), the kept
  rows' used positions moved down in place (or, where something else still holds a
  buffer, copied into a new one). For the move in place the op must be queued after the
  step in flight and the extracts have ended (their tasks hold the buffers until they
  run), and the next step's layer ops must be queued after it has run (likewise): the
  generation batch does both at the start of its next step (mlx/generator.py);
- elsewhere (GPU, float16 caches, no kernels) MLX's gather, as mlx-lm does, minus the wait.
Other cache types keep their own methods (a quantized cache, engine/kv/quantized.py: its
filter / extract / roll move the packed words, scales and biases with MLX's ops).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, dynamic_roll

from pipeserve.engine.kv.quantized import BatchQuantizedKVCache


def keep_rows(caches: list[Any], keep: list[int], ext: Any | None) -> list[mx.array]:
    """In place: each cache holds only rows `keep` (non-empty, ascending), its common
    left padding dropped, like BatchKVCache.filter (the kernel op keeps the capacity).
    Returns the kernel op's buffers, not yet queued (see the module's note)."""
    shared: dict[tuple[int, ...], tuple[mx.array, mx.array]] = {}
    copies: list[tuple[Any, tuple[int, int, int]]] = []  # layers the kernel op copies
    rows = mx.array(keep)
    for cache in caches:
        if type(cache) is not BatchKVCache:
            cache.filter(keep)
            continue
        every_row: list[int] = cache.left_padding.tolist()  # evaluated: no wait
        padding = [every_row[i] for i in keep]
        shift = min(padding)
        start, stop = shift, cache._idx
        cache._idx -= shift
        padding = [p - shift for p in padding]
        key = (cache._idx, *padding)
        if key not in shared:  # every layer's are equal: one pair of arrays for all
            offsets = [cache._idx - p for p in padding]
            shared[key] = (mx.array(padding), mx.array(offsets))
        cache.left_padding, cache.offset = shared[key]
        if cache.keys is None:
            continue
        if kernel_rewrites(cache, ext):
            copies.append((cache, (start, stop, cache.keys.shape[2])))
        else:
            cache.keys = cache.keys[rows][..., shift:, :]
            cache.values = cache.values[rows][..., shift:, :]
    return _copy_rows(copies, keep, ext)


def row_cache(caches: list[Any], index: int, ext: Any | None) -> tuple[list[Any], list[mx.array]]:
    """Row `index`'s cache of each layer as a KVCache holding its used positions only
    (BatchKVCache.extract), other caches by their own `extract`; and the kernel op's
    buffers, queued already."""
    out: list[Any] = []
    copies: list[tuple[Any, tuple[int, int, int]]] = []
    for cache in caches:
        start = cache.left_padding.tolist()[index] if type(cache) is BatchKVCache else 0
        if (
            type(cache) is not BatchKVCache
            or not kernel_rewrites(cache, ext)
            or start >= cache._idx
        ):
            out.append(cache.extract(index))  # (no positions yet: mlx-lm's empty extract)
            continue
        row = KVCache()
        row.keys, row.values, row.offset = cache.keys, cache.values, cache._idx - start
        out.append(row)
        copies.append((row, (start, cache._idx, cache._idx - start)))
    made = _copy_rows(copies, [index], ext)
    if made:
        mx.async_eval(made)
    return out, made


def kernel_rewrites(cache: Any, ext: Any | None) -> bool:
    """The CPU kernels' cache ops (cache_rows, roll_rows) take this cache's buffers."""
    return (
        ext is not None
        and cache.keys is not None
        and cache.keys.dtype == mx.float32
        and cache.values.dtype == mx.float32
    )


def _copy_rows(
    copies: list[tuple[Any, tuple[int, int, int]]], rows: list[int], ext: Any
) -> list[mx.array]:
    """Each cache's keys / values replaced by rows `rows` of them, positions start..stop - 1
    at 0.. of a buffer of `capacity`: one kernel op per distinct (start, stop, capacity)
    (every layer's are the same). Returns the new buffers, not queued."""
    groups: dict[tuple[int, int, int], list[Any]] = {}
    for cache, span in copies:
        groups.setdefault(span, []).append(cache)
    made: list[mx.array] = []
    for (start, stop, capacity), layers in groups.items():
        buffers = [b for layer in layers for b in (layer.keys, layer.values)]
        out = ext.cache_rows(buffers, rows, start, stop, capacity)
        for i, layer in enumerate(layers):
            layer.keys, layer.values = out[2 * i], out[2 * i + 1]
        made += out
    return made


def trim_rows(cache: list[Any], stale: list[int], ext: Any | None = None) -> None:
    """Forget the last stale[i] positions of row i of a BatchKVCache (per layer): all
    rows trim the fewest, the others roll right by the rest (their left padding grows).
    With the CPU kernels (`ext`, float32 caches) the rows that move move only their used
    positions, every layer in one op (`ext.roll_rows`); else mlx-lm's `dynamic_roll`
    of the whole buffers."""
    common = min(stale)
    shifts = [s - common for s in stale]
    if any(shifts):
        by = mx.array(shifts)
        rolled = _roll_with_kernel(cache, shifts, ext)
        for layer in cache:
            if type(layer) is BatchQuantizedKVCache:
                layer.roll(by)  # each of the packed words, scales and biases
                continue
            if id(layer) not in rolled:
                layer.keys = dynamic_roll(layer.keys, by[:, None], axis=2)
                layer.values = dynamic_roll(layer.values, by[:, None], axis=2)
            layer.offset = layer.offset - by
            layer.left_padding = layer.left_padding + by
    if common:
        for layer in cache:
            layer.trim(common)


@contextmanager
def kernel_finalize(cache: list[Any], ext: Any | None) -> Iterator[None]:
    """Within it, mlx-lm's prefill of prompts of different lengths (right-padded, then
    `finalize`d layer by layer: a `dynamic_roll` gather of every buffer's whole capacity,
    65 ms for 8 SmolLM2 prompts, 4 % of an 8-stream round) moves only the rows' used
    positions, every float32 BatchKVCache layer in one `ext.roll_rows` op, when the first
    layer is finalized; the other layers' own `finalize` then finds nothing to do. Same
    positions and masks as mlx-lm's (the left padding's contents are never read)."""
    layers = [
        layer for layer in cache if type(layer) is BatchKVCache and kernel_rewrites(layer, ext)
    ]
    if not layers:
        yield
        return
    first = layers[0]

    def finalize() -> None:
        padded = [layer for layer in layers if layer._right_padding is not None]
        if padded:
            _roll_padding_out(padded, ext)
        BatchKVCache.finalize(first)

    # an instance attribute over the class method: mlx-lm calls `c.finalize()`
    first.finalize = finalize  # type: ignore[method-assign]
    try:
        yield
    finally:
        del first.finalize


def _roll_padding_out(layers: list[Any], ext: Any) -> None:
    """BatchKVCache.finalize for `layers` (each right-padded alike: one prefill's)."""
    padding = layers[0]._right_padding
    shifts: list[int] = padding.tolist()
    _roll_with_kernel(layers, shifts, ext)
    for layer in layers:
        layer.offset = layer.offset - padding
        layer.left_padding = layer.left_padding + padding
        layer._right_padding = None


def _roll_with_kernel(cache: list[Any], shifts: list[int], ext: Any | None) -> set[int]:
    """Rows moved right by `shifts` in the layers the kernel op takes (their ids)."""
    layers = [
        layer for layer in cache if type(layer) is BatchKVCache and kernel_rewrites(layer, ext)
    ]
    if ext is None or not layers:
        return set()
    starts: list[int] = layers[0].left_padding.tolist()  # every layer's are equal
    buffers = [b for layer in layers for b in (layer.keys, layer.values)]
    moved = ext.roll_rows(buffers, shifts, starts, layers[0]._idx)
    for i, layer in enumerate(layers):
        layer.keys, layer.values = moved[2 * i], moved[2 * i + 1]
    return {id(layer) for layer in layers}
