"""How an embedding engine gives way to chat decoding in the same server."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Yielding:
    """How an embedding engine gives way to chat: while `chat_running()` says a
    generation engine of the same server is decoding, each batch is at most
    `batch_tokens` padded tokens and is followed by a pause that keeps the embedding
    engine's share of the time at `share` (YAML embedding.chat_share; 1: no yielding)."""

    chat_running: Callable[[], bool] = lambda: False
    share: float = 1.0
    batch_tokens: int = 512

    def budget(self, configured: int, chat: bool) -> int:
        return min(configured, self.batch_tokens) if chat and self.share < 1 else configured

    def pause(self, seconds: float) -> float:
        return seconds * (1 / self.share - 1) if self.share < 1 else 0.0
