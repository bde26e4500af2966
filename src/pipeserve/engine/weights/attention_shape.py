"""The attention shape a model's config.json declares (a multimodal checkpoint's
`text_config` merged over it): the head size, and the key and value elements one token
adds to the cache over every layer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    return {**config, **(config.get("text_config") or {})}


def head_dim(config: Mapping[str, Any]) -> int | None:
    """`head_dim`, else hidden size / attention heads; None when the config says neither."""
    merged = text_config(config)
    dim = merged.get("head_dim")
    if isinstance(dim, int) and dim > 0:
        return dim
    hidden, heads = merged.get("hidden_size"), merged.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def kv_elements_per_token(config: Mapping[str, Any]) -> int | None:
    """layers x kv heads x head size x 2 (keys and values); None without those fields."""
    merged = text_config(config)
    dim, layers = head_dim(merged), merged.get("num_hidden_layers")
    kv_heads = merged.get("num_key_value_heads") or merged.get("num_attention_heads")
    if dim is None or not isinstance(layers, int) or not isinstance(kv_heads, int):
        return None
    return layers * kv_heads * dim * 2
