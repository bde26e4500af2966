"""A prompt's last token in its last prefill chunk (the output projection for it alone).

mlx-lm prefills a prompt but its last token, then feeds that token to the new row's
first decode step, whose logits give the first generated token: the time to the first
token holds the prefill and a whole one-token pass through every layer. Where a model's
forward is exactly `head(self.model(inputs, cache))` (the families below, by mlx-lm
module), the last chunk can take the last token too: the layers run once over chunk +
last token, the output projection only over the last position (a 262k-row head over
every position would cost more than the layers), and the first decode step samples from
those logits instead of running the model (`ReplayLogits`). The generator decides which
rows fold (engine/mlx/generator.py); the scheduler keeps their prompt snapshot (all but
the last token) for the prefix cache.
"""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx

# mlx-lm modules whose Model forward is `lm_head(self.model(...))` or, with tied
# embeddings (no lm_head), `self.model.embed_tokens.as_linear(self.model(...))`, nothing
# after it (no soft-capping): their last prompt token may fold into the prefill.
FOLD_FAMILIES = ("mlx_lm.models.gemma3_text",)


def _fold_classes() -> tuple[type, ...]:
    return tuple(importlib.import_module(name).Model for name in FOLD_FAMILIES)


FOLD_CLASSES = _fold_classes()


def folds(model: Any) -> bool:
    """Whether `model`'s last prompt token may run in its last prefill chunk."""
    return type(model) in FOLD_CLASSES


def last_logits(model: Any, inputs: mx.array, cache: list[Any]) -> mx.array:
    """(B, vocab) logits of each row's last position of `inputs` (B, L), the layers run
    over all L (the cache takes them), the output projection over the last alone.
    Call only where `folds(model)`."""
    hidden = model.model(inputs, cache)[:, -1:, :]
    head = model.lm_head if "lm_head" in model else model.model.embed_tokens.as_linear
    logits: mx.array = head(hidden)[:, -1, :]
    return logits


class ReplayLogits:
    """Stands in for the model in a new row's first decode step: hands back the logits
    the fold computed, (B, 1, vocab), whatever the step passes."""

    def __init__(self, logits: mx.array) -> None:
        self.logits = logits[:, None, :]

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        return self.logits
