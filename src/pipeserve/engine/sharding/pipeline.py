"""pipeserve's layer-range pipeline split for architectures whose mlx-lm module has no
`pipeline()` (support.PIPELINE_ADAPTERS), the pattern of mlx-lm's own and of exo's:

- each rank keeps a contiguous range of layers; as in mlx-lm, rank 0 runs the LAST
  layers and rank size-1 the first, so `split` means the same for both kinds;
- the first kept layer of a rank that does not hold layer 0 receives the hidden state
  from rank+1 (`recv_like`); the last kept layer of a rank that does not hold the final
  layer sends it on to rank-1, and the KV cache is made to depend on that send, so a
  prefill chunk that only evaluates the cache still sends;
- the final norm runs on every rank on rank 0's output (`all_gather`), so every rank
  computes the same logits and samples the same token: BatchGenerator runs unmodified.

Per-architecture fix-ups (metadata the model's `__call__` indexes by layer number) are
data in FIXUPS.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx import nn


class _Wrapper(nn.Module):
    """Reads attributes it lacks from the wrapped layer (llama asks `layer.use_sliding`)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "layer":
                raise
            return getattr(self.layer, name)


class RecvThenLayer(_Wrapper):
    """First local layer: its input is the previous stage's output, not the embedding."""

    def __init__(self, layer: nn.Module, source: int, group: Any) -> None:
        super().__init__()
        self.layer = layer
        self._source, self._group = source, group

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        x = mx.distributed.recv_like(x, self._source, group=self._group)
        return self.layer(x, *args, **kwargs)


class LayerThenSend(_Wrapper):
    """Last local layer: send the hidden state on, tied into the KV cache."""

    def __init__(self, layer: nn.Module, target: int, group: Any) -> None:
        super().__init__()
        self.layer = layer
        self._target, self._group = target, group

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        x = self.layer(x, *args, **kwargs)
        x = mx.distributed.send(x, self._target, group=self._group)
        cache = kwargs.get("cache", args[1] if len(args) > 1 else None)
        if cache is not None and getattr(cache, "keys", None) is not None:
            cache.keys = mx.depends(cache.keys, x)
        return x


class GatherThenNorm(nn.Module):
    """The final norm, applied on every rank to rank 0's (the last stage's) output."""

    def __init__(self, norm: nn.Module, group: Any) -> None:
        super().__init__()
        self.norm = norm
        self._group = group

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.shape[0]
        x = mx.distributed.all_gather(x, group=self._group)[:rows]
        return self.norm(x)


def layer_ranges(layers: int, size: int, split: list[int] | None) -> list[tuple[int, int]]:
    """[start, end) of every rank; rank 0 holds the last layers (mlx-lm's convention)."""
    if split is None:
        base, extra = divmod(layers, size)
        split = [base + (1 if rank < extra else 0) for rank in range(size)]
    if len(split) != size or sum(split) != layers or min(split) < 1:
        raise ValueError(f"split {split} does not cover {layers} layers on {size} ranks")
    return [(sum(split[r + 1 :]), sum(split[r + 1 :]) + split[r]) for r in range(size)]


# Per architecture: (attribute, layer kind, value when no local layer is of that kind) of
# the indices its `__call__` takes mask sources from; they index the local layers after
# the split, and `layer_types` is sliced with the layers.
FIXUPS: dict[str, tuple[tuple[str, str, int | None], ...]] = {
    "gpt_oss": (("swa_idx", "sliding_attention", 0), ("ga_idx", "full_attention", 0)),
    "llama": (("fa_idx", "full_attention", 0), ("swa_idx", "sliding_attention", None)),
}


def _fix_layer_metadata(inner: Any, arch: str, start: int, end: int) -> None:
    fixes = FIXUPS.get(arch, ())
    if not fixes or getattr(inner, "layer_types", None) is None:
        return
    inner.layer_types = list(inner.layer_types[start:end])
    for attr, kind, missing in fixes:
        local = inner.layer_types
        setattr(inner, attr, local.index(kind) if kind in local else missing)


def split_layers(
    model: nn.Module, group: Any, split: list[int] | None, arch: str
) -> tuple[int, int]:
    """Keep this rank's layers (call on a lazily loaded model: the rest are never read)."""
    inner = model.model
    size, rank = group.size(), group.rank()
    start, end = layer_ranges(len(inner.layers), size, split)[rank]
    layers = list(inner.layers[start:end])
    if start > 0:
        layers[0] = RecvThenLayer(layers[0], rank + 1, group)
    if rank > 0:
        layers[-1] = LayerThenSend(layers[-1], rank - 1, group)
    inner.layers = layers
    inner.norm = GatherThenNorm(inner.norm, group)
    _fix_layer_metadata(inner, arch, start, end)
    return start, end
