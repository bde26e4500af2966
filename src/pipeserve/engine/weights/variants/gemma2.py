"""Gemma 2 with its sliding-window layers, over mlx-lm's gemma2 modules.

Gemma 2 alternates local layers, which attend to the last `sliding_window` positions
(the token itself included), with global ones: layer i is global where
i % sliding_window_pattern == pattern - 1, so with Gemma 2's pattern of 2 the even layers
are local (Hugging Face's `is_sliding = not layer_idx % 2`, llama.cpp's swa pattern 2).
Local layers keep mlx-lm's RotatingKVCache of the window's size and take the window's
mask; the rest is mlx-lm's gemma2 (soft-capping of the attention scores and of the final
logits, the four `1 + w` norms of a block, the sqrt(hidden) embedding scale), whose
parameter names this keeps. The attention also broadcasts a batch's mask (B, 1, L, S)
over each kv head's group of query heads: mlx-lm's lines it up with the kv heads, which
applied row b's mask to kv head b on two rows (padded rows' logits off by ~5 on a tiny
model) and failed on three.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma2
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache


@dataclass
class ModelArgs(gemma2.ModelArgs):
    sliding_window: int | None = None  # None: every layer global (mlx-lm's gemma2)
    sliding_window_pattern: int = 2  # every 2nd layer global, the others local


def window(args: Any, layer: int) -> int | None:
    """Layer `layer`'s window under `args` (this ModelArgs), or None: a global layer."""
    size: int | None = args.sliding_window
    pattern: int = args.sliding_window_pattern
    return None if size is None or layer % pattern == pattern - 1 else size


class Attention(gemma2.Attention):
    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        B, L, _ = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = 0 if cache is None else cache.offset
        queries, keys = self.rope(queries, offset=offset), self.rope(keys, offset=offset)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        return self.o_proj(self._attend(queries * self.scale, keys, values, mask))

    def _attend(self, queries: mx.array, keys: mx.array, values: mx.array,
                mask: Any) -> mx.array:  # fmt: skip
        B, _, L, D = queries.shape
        # (B, kv heads, repeats, L, D): each kv head's group of query heads
        queries = queries.reshape(B, self.n_kv_heads, self.repeats, L, D)
        scores = queries @ mx.expand_dims(keys, 2).swapaxes(-1, -2)
        cap = self.attn_logit_softcapping
        scores = mx.tanh(scores / cap) * cap
        if isinstance(mask, mx.array):
            mask = mask.reshape(*mask.shape[:-2], 1, *mask.shape[-2:]) if mask.ndim == 4 else mask
            if mask.dtype == mx.bool_:
                scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
            else:
                scores = scores + mask
        scores = mx.softmax(scores, precise=True, axis=-1)
        output = (scores @ mx.expand_dims(values, 2)).reshape(B, self.n_heads, L, D)
        return output.transpose(0, 2, 1, 3).reshape(B, L, -1)


class TransformerBlock(gemma2.TransformerBlock):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.self_attn = Attention(args)


class GemmaModel(gemma2.GemmaModel):
    def __init__(self, args: ModelArgs) -> None:
        nn.Module.__init__(self)
        self.args = args
        self.vocab_size = args.vocab_size
        self.num_hidden_layers = args.num_hidden_layers
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        self.norm = gemma2.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        h = self.embed_tokens(inputs)
        h = h * (self.args.hidden_size**0.5)
        caches = [None] * len(self.layers) if cache is None else cache
        masks: dict[int | None, Any] = {}  # per window: made from its first layer's cache
        for i, (layer, layer_cache) in enumerate(zip(self.layers, caches)):
            size = window(self.args, i)
            if size not in masks:
                masks[size] = create_attention_mask(
                    h, layer_cache, window_size=size, return_array=True
                )
            h = layer(h, masks[size], layer_cache)
        out: mx.array = self.norm(h)
        return out


class Model(gemma2.Model):
    def __init__(self, args: ModelArgs) -> None:
        nn.Module.__init__(self)
        self.model_type = args.model_type
        self.final_logit_softcapping = args.final_logit_softcapping
        self.model = GemmaModel(args)
        self.args = args

    def make_cache(self) -> list[Any]:
        """A window-sized ring buffer per local layer, a growing cache per global one."""
        windows = [window(self.args, i) for i in range(self.args.num_hidden_layers)]
        return [KVCache() if w is None else RotatingKVCache(max_size=w) for w in windows]
