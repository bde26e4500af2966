"""Prefix KV cache: reuse the longest cached prompt prefix across requests.

A thin policy layer over mlx-lm's `LRUPromptCache` (a token trie of KV caches with a
byte-bounded LRU, the one mlx_lm.server uses): it enforces our options (enabled,
max_bytes, min_tokens), always leaves at least one prompt token to process (the
model must produce logits for the first generated token) and counts hits.
Used only from the engine thread: KV arrays belong to the thread that made them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from pipeserve.config.models import PrefixCacheOptions

_MODEL_KEY = "model"  # one cache per engine, so one key
UNBOUNDED = 1 << 62


def _key(adapter: str | None) -> str:
    """Entries of a LoRA adapter's rows apart from the base's (and each other's)."""
    return _MODEL_KEY if adapter is None else f"{_MODEL_KEY}:{adapter}"


@dataclass(slots=True)
class CacheLookup:
    cache: list[Any] | None  # KV cache to start from (a private copy), or None
    cached_tokens: int  # prompt tokens covered by `cache`
    rest: list[int]  # prompt tokens still to process (never empty)


class PrefixCache:
    """bounded=False: nothing is evicted or refused for its size here; the owner calls
    trim_to_bytes (a sharded model's rank 0, which sends every rank the same trims)."""

    def __init__(self, options: PrefixCacheOptions, bounded: bool = True) -> None:
        self.options = options
        self.enabled = options.enabled and options.max_bytes > 0
        self.bounded = bounded
        limit = options.max_bytes if bounded else UNBOUNDED
        self._lru = LRUPromptCache(max_size=1 << 30, max_bytes=limit)
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        return int(self._lru.nbytes)

    def __len__(self) -> int:
        return len(self._lru)

    def fetch(self, prompt: list[int], adapter: str | None = None) -> CacheLookup:
        """`adapter`: the row's LoRA adapter (its KV differs from the base's)."""
        if not self.enabled or len(prompt) < self.options.min_tokens:
            return CacheLookup(None, 0, prompt)
        cache, rest = self._lru.fetch_nearest_cache(_key(adapter), prompt)
        if cache is not None and not rest:
            # Exact hit: re-process the last token so there are logits to sample from.
            trimmed: Any = can_trim_prompt_cache(cache) and trim_prompt_cache(cache, 1)
            if trimmed == 1:  # mlx-lm returns the number of tokens trimmed (annotated as a list)
                rest = prompt[-1:]
            else:
                cache, rest = None, prompt
        if cache is None:
            self.misses += 1
            return CacheLookup(None, 0, prompt)
        self.hits += 1
        return CacheLookup(cache, len(prompt) - len(rest), list(rest))

    def store(
        self,
        tokens: list[int],
        cache: list[Any],
        kind: str = "assistant",
        adapter: str | None = None,
    ) -> None:
        """Remember the KV state of `tokens`: a prompt ("user") or prompt plus answer."""
        if not self.enabled or len(tokens) < self.options.min_tokens or not cache:
            return
        nbytes = sum(c.nbytes for c in cache)
        if self.bounded and nbytes > self.options.max_bytes:
            return
        # A batch's extract is a lazy slice: unevaluated, it pins the whole batch's KV
        # buffers (all rows, the full allocation) for as long as the entry lives.
        mx.async_eval([c.state for c in cache])  # no sync: the copy runs in stream order
        self._lru.insert_cache(_key(adapter), list(tokens), cache, cache_type=kind)

    def trim_to_bytes(self, budget: float, scale: float = 1.0) -> int | None:
        """Evict in LRU order until nbytes * scale fits `budget`; the entry count left,
        or None when nothing was evicted (see trim_to_count)."""
        if self.nbytes * scale <= budget:
            return None
        while len(self) and self.nbytes * scale > budget:
            self._lru.trim_to(n_sequences=len(self) - 1)
        return len(self)

    def trim_to_count(self, count: int) -> None:
        """Evict in LRU order down to `count` entries: the same entries as trim_to_bytes
        evicted on a cache that saw the same stores."""
        self._lru.trim_to(n_sequences=count)

    def clear(self) -> None:
        self._lru.trim_to(n_sequences=0)
