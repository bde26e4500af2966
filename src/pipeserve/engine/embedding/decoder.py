"""An mlx-lm decoder as an embedder (its final hidden states, pooled) or as a yes/no
reranker (Qwen3-Reranker style: the probability of `yes` against `no` at the last
token). Inputs are padded on the right, so the causal mask keeps padding out of every
real position without a mask of its own."""

from __future__ import annotations

from typing import Any

import mlx.core as mx


class DecoderBackbone:
    decoder = True
    packs = False

    def __init__(self, model: Any, yes_id: int | None, no_id: int | None) -> None:
        self.model = model
        self.inner = model.model  # mlx-lm's convention: the stack without its LM head
        self.yes_id = yes_id
        self.no_id = no_id
        self.width = int(self.inner.embed_tokens.weight.shape[-1])
        if hasattr(self.inner.embed_tokens, "scales"):  # quantized: packed columns
            self.width = int(model.args.hidden_size)
        self.vocab_size = int(self.inner.embed_tokens.weight.shape[0])
        self.classifies = yes_id is not None and no_id is not None

    def hidden(self, ids: mx.array, mask: mx.array, types: mx.array) -> mx.array:
        out: mx.array = self.inner(ids)
        return out

    def packed(self, ids: Any, types: Any, lengths: Any, scoring: bool) -> Any:
        raise NotImplementedError("a decoder takes padded batches")

    def head(self, last: mx.array) -> mx.array:
        """The model's logits for the vectors `last` [batch, width]."""
        lm_head = getattr(self.model, "lm_head", None)
        if lm_head is not None:
            logits: mx.array = lm_head(last)
        else:  # tied embeddings
            logits = self.inner.embed_tokens.as_linear(last)
        return logits

    def score(self, hidden: mx.array, lengths: mx.array) -> mx.array:
        """P(yes) / (P(yes) + P(no)) at each input's last token."""
        assert self.yes_id is not None and self.no_id is not None
        index = (lengths - 1).astype(mx.int32)
        last = mx.take_along_axis(hidden, index[:, None, None], axis=1)[:, 0]
        logits = self.head(last).astype(mx.float32)
        pair = mx.stack([logits[:, self.no_id], logits[:, self.yes_id]], axis=-1)
        return mx.softmax(pair, axis=-1)[:, 1]


def single_token(tokenizer: Any, text: str) -> int | None:
    """The id of `text` when it is exactly one token (no special tokens added); tokenizer:
    a `tokenizers.Tokenizer`."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return int(ids[0]) if len(ids) == 1 else None
