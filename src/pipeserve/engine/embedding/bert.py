"""A BERT-style encoder in MLX (BERT, MiniLM, bge, e5; XLM-RoBERTa's position offset;
nomic-bert's rotary positions and SwiGLU feed-forward, as its GGUF is converted),
loaded from a Hugging Face folder (config.json + *.safetensors), and the sequence
classification head of a cross-encoder (BertForSequenceClassification).

    model = load_bert(folder)           # on the engine thread
    hidden = model(ids, mask, types)    # [batch, length, hidden]; mask 1 = real token
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from pipeserve.engine.embedding.spec import read_json

_PREFIXES = ("bert.", "roberta.", "model.")


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    position_offset: int  # XLM-RoBERTa counts positions from pad_token_id + 1
    num_labels: int  # a cross-encoder's outputs (0: a plain encoder)
    # nomic-bert: rotary positions (NeoX style, this base) instead of learned ones, and a
    # SwiGLU feed-forward (silu(gate(x)) * up(x)) instead of GELU
    rope_base: float | None = None
    gated: bool = False

    @classmethod
    def read(cls, model_dir: Path) -> BertConfig:
        raw = read_json(model_dir / "config.json")
        if raw.get("model_type") == "nomic_bert" and "hidden_size" not in raw:
            raise ValueError(
                f"{model_dir}: a Hugging Face nomic-bert folder is not supported (its GGUF is)"
            )
        roberta = raw.get("model_type") in ("xlm-roberta", "roberta")
        classifier = any("SequenceClassification" in a for a in raw.get("architectures", []))
        labels = raw.get("id2label") or {"0": "LABEL_0"}
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=int(raw["num_attention_heads"]),
            intermediate_size=int(raw["intermediate_size"]),
            max_position_embeddings=int(raw.get("max_position_embeddings", 512)),
            type_vocab_size=int(raw.get("type_vocab_size", 2)),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
            position_offset=int(raw.get("pad_token_id", 1)) + 1 if roberta else 0,
            num_labels=len(labels) if classifier else 0,
            rope_base=float(raw["rotary_emb_base"]) if "rotary_emb_base" in raw else None,
            gated=raw.get("hidden_act") == "swiglu",
        )


class Embeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.rope_base is None:  # else the attention rotates q and k
            self.position_embeddings = nn.Embedding(
                config.max_position_embeddings, config.hidden_size
            )
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.offset = config.position_offset

    def __call__(self, ids: mx.array, types: mx.array) -> mx.array:
        h = self.word_embeddings(ids)
        if "position_embeddings" in self:
            positions = mx.arange(ids.shape[1]) + self.offset
            h = h + self.position_embeddings(positions)[None]
        return self.LayerNorm(h + self.token_type_embeddings(types))


class SelfAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.rope_base = config.rope_base

    def __call__(self, h: mx.array, bias: mx.array) -> mx.array:
        batch, length, width = h.shape
        size = width // self.heads

        def split(x: mx.array) -> mx.array:
            return x.reshape(batch, length, self.heads, size).transpose(0, 2, 1, 3)

        q, k, v = split(self.query(h)), split(self.key(h)), split(self.value(h))
        if self.rope_base is not None:
            q = mx.fast.rope(q, size, traditional=False, base=self.rope_base, scale=1.0, offset=0)
            k = mx.fast.rope(k, size, traditional=False, base=self.rope_base, scale=1.0, offset=0)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(size), mask=bias)
        return out.transpose(0, 2, 1, 3).reshape(batch, length, width)


class Output(nn.Module):
    """dense -> residual -> LayerNorm (the `attention.output` and `output` blocks)."""

    def __init__(self, width_in: int, width: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(width_in, width)
        self.LayerNorm = nn.LayerNorm(width, eps=eps)

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        setattr(self, "self", SelfAttention(config))  # noqa: B010 (the weights' name)
        self.output = Output(config.hidden_size, config.hidden_size, config.layer_norm_eps)

    def __call__(self, h: mx.array, bias: mx.array) -> mx.array:
        attend: SelfAttention = getattr(self, "self")  # noqa: B009
        return self.output(attend(h, bias), h)


# erf(x) on [-4, 4] as x * P(x^2) / Q(x^2) (Eigen's float erf; |error| < 2e-6 in
# GELU), clamped outside: only multiplies and adds, which mx.compile fuses into one pass.
# MLX's CPU `erf` is a scalar loop (~36 ns per element, 2-8x the matmul before it).
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
          -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
          -1.60960333262415e-02)  # fmt: skip
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
          -7.37332916720468e-03, -1.42647390514189e-02)  # fmt: skip


def _gelu_erf(v: mx.array) -> mx.array:
    """BERT's exact GELU, 0.5 * v * (1 + erf(v / sqrt(2)))."""
    x = mx.clip(v * 0.7071067811865476, -4.0, 4.0)
    x2 = x * x
    p = x2 * _ERF_P[0] + _ERF_P[1]
    for a in _ERF_P[2:]:
        p = x2 * p + a
    q = x2 * _ERF_Q[0] + _ERF_Q[1]
    for b in _ERF_Q[2:]:
        q = x2 * q + b
    return 0.5 * v * (1.0 + x * p / q)


gelu_erf = mx.compile(_gelu_erf, shapeless=True)


class Intermediate(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)  # up, when gated
        if config.gated:
            self.gate = nn.Linear(config.hidden_size, config.intermediate_size)

    def __call__(self, h: mx.array) -> mx.array:
        if "gate" in self:
            return nn.silu(self.gate(h)) * self.dense(h)
        out: mx.array = gelu_erf(self.dense(h))
        return out


class Layer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.intermediate = Intermediate(config)
        eps = config.layer_norm_eps
        self.output = Output(config.intermediate_size, config.hidden_size, eps)

    def __call__(self, h: mx.array, bias: mx.array) -> mx.array:
        h = self.attention(h, bias)
        return self.output(self.intermediate(h), h)


class Encoder(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = [Layer(config) for _ in range(config.num_hidden_layers)]


class Pooler(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def __call__(self, first: mx.array) -> mx.array:
        return mx.tanh(self.dense(first))


class BertModel(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)
        if config.num_labels:
            self.pooler = Pooler(config)
            self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def __call__(self, ids: mx.array, mask: mx.array, types: mx.array) -> mx.array:
        """The last layer's token vectors; padding (mask 0) is never attended to."""
        h = self.embeddings(ids, types)
        bias = mx.where(mask[:, None, None, :] > 0, 0.0, -1e9).astype(h.dtype)
        for layer in self.encoder.layer:
            h = layer(h, bias)
        return h

    def classify(self, hidden: mx.array) -> mx.array:
        """A cross-encoder's logits from its token vectors: pooler(CLS) -> classifier."""
        return self.classifier(self.pooler(hidden[:, 0]))


def load_bert(model_dir: Path) -> BertModel:
    """The encoder with its weights (float32), evaluated; call it on the engine thread."""
    config = BertConfig.read(model_dir)
    model = BertModel(config)
    weights: dict[str, Any] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        weights.update(mx.load(str(file)))
    wanted = dict(nn.utils.tree_flatten(model.parameters()))
    renamed = {_strip(k): v.astype(mx.float32) for k, v in weights.items()}
    missing = sorted(set(wanted) - set(renamed))
    if missing:
        raise ValueError(f"{model_dir}: weights missing for {', '.join(missing[:5])}")
    model.load_weights([(k, renamed[k]) for k in wanted])
    mx.eval(model.parameters())
    return model


def _strip(key: str) -> str:
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key
