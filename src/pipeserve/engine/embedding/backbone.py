"""Which network an embedding / rerank folder holds, loaded behind one interface:

backbone.hidden(ids, mask, types) -> [batch, length, width] token vectors
backbone.score(hidden, lengths)   -> [batch] relevance scores (rerank models)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx

from pipeserve.engine.embedding.bert import BertModel, load_bert
from pipeserve.engine.embedding.spec import ENCODER_TYPES, read_json


class Backbone(Protocol):
    decoder: bool
    width: int
    vocab_size: int
    classifies: bool  # it can score (a cross-encoder head, or yes/no tokens)

    def hidden(self, ids: mx.array, mask: mx.array, types: mx.array) -> mx.array: ...

    def score(self, hidden: mx.array, lengths: mx.array) -> mx.array: ...


class EncoderBackbone:
    decoder = False

    def __init__(self, model: BertModel) -> None:
        self.model = model
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


def is_encoder(model_dir: Path) -> bool:
    """A BERT-style encoder folder (else an mlx-lm decoder)."""
    return read_json(model_dir / "config.json").get("model_type") in ENCODER_TYPES


def load_backbone(
    model_dir: Path, load_decoder: Any, yes_no: tuple[int | None, int | None]
) -> Backbone:
    """On the engine thread. load_decoder(): the mlx-lm model (engine/weights/loader.py)."""
    if is_encoder(model_dir):
        return EncoderBackbone(load_bert(model_dir))
    from pipeserve.engine.embedding.decoder import DecoderBackbone

    return DecoderBackbone(load_decoder(), *yes_no)
