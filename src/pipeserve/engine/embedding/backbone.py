"""Which network an embedding / rerank folder holds, loaded behind one interface:

backbone.hidden(ids, mask, types) -> [batch, length, width] token vectors
backbone.score(hidden, lengths)   -> [batch] relevance scores (rerank models)

An encoder on the CPU with the kernels also takes packed batches (`packs`: no padding):
backbone.packed(ids, types, lengths, scoring) -> (sum(lengths), width) token vectors, or
[batch] scores when scoring (bert_kernel.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from pipeserve.engine.embedding.bert import BertModel, load_bert
from pipeserve.engine.embedding.bert_kernel import PackedBert
from pipeserve.engine.embedding.spec import ENCODER_TYPES, read_json


class Backbone(Protocol):
    decoder: bool
    width: int
    vocab_size: int
    classifies: bool  # it can score (a cross-encoder head, or yes/no tokens)
    packs: bool  # it takes packed batches (packed())

    def hidden(self, ids: mx.array, mask: mx.array, types: mx.array) -> mx.array: ...

    def score(self, hidden: mx.array, lengths: mx.array) -> mx.array: ...

    def packed(
        self, ids: np.ndarray, types: np.ndarray, lengths: np.ndarray, scoring: bool
    ) -> np.ndarray: ...


class EncoderBackbone:
    decoder = False

    def __init__(self, model: BertModel, kernel: PackedBert | None = None) -> None:
        self.model = model
        self.kernel = kernel
        self.packs = kernel is not None
        self.width = model.config.hidden_size
        self.vocab_size = model.config.vocab_size
        self.classifies = model.config.num_labels > 0

    def hidden(self, ids: mx.array, mask: mx.array, types: mx.array) -> mx.array:
        out: mx.array = self.model(ids, mask, types)
        return out

    def score(self, hidden: mx.array, lengths: mx.array) -> mx.array:
        """One label: its sigmoid; two or more: the softmax of the last label."""
        logits = self.model.classify(hidden).astype(mx.float32)
        if logits.shape[-1] == 1:
            return mx.sigmoid(logits[:, 0])
        return mx.softmax(logits, axis=-1)[:, -1]

    def packed(
        self, ids: np.ndarray, types: np.ndarray, lengths: np.ndarray, scoring: bool
    ) -> np.ndarray:
        """Sequences laid end to end through the kernel op: their token vectors, or each
        one's score (the classifier on its first token's vector)."""
        assert self.kernel is not None
        vectors = self.kernel.encode(ids, types, lengths)
        if not scoring:
            return vectors
        first = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        scores = self.score(mx.array(vectors[first])[:, None, :], mx.array(lengths))
        return np.array(scores)


def is_encoder(model_dir: Path) -> bool:
    """A BERT-style encoder folder (else an mlx-lm decoder)."""
    return read_json(model_dir / "config.json").get("model_type") in ENCODER_TYPES


def load_backbone(
    model_dir: Path, load_decoder: Any, yes_no: tuple[int | None, int | None]
) -> Backbone:
    """On the engine thread. load_decoder(): the mlx-lm model (engine/weights/loader.py)."""
    if is_encoder(model_dir):
        model = load_bert(model_dir)
        return EncoderBackbone(model, PackedBert.build(model))
    from pipeserve.engine.embedding.decoder import DecoderBackbone

    return DecoderBackbone(load_decoder(), *yes_no)
