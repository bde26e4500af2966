"""An independent numpy implementation of a BERT encoder and sentence-transformers'
mean pooling + normalisation, from the safetensors file (no MLX, no pipeserve code):
the reference the MLX encoder's vectors are checked against."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file
from tokenizers import Tokenizer


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def _erf(x: np.ndarray) -> np.ndarray:
    """Abramowitz & Stegun 7.1.26 (absolute error below 1.5e-7)."""
    t = 1.0 / (1.0 + 0.3275911 * np.abs(x))
    poly = t * (
        0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429)))
    )
    return np.sign(x) * (1.0 - poly * np.exp(-x * x))


def _gelu(x: np.ndarray) -> np.ndarray:
    """BERT's exact GELU, x * Phi(x)."""
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


class NumpyBert:
    def __init__(self, folder: Path) -> None:
        raw = load_file(folder / "model.safetensors")
        self.w = {k.removeprefix("bert."): v.astype(np.float64) for k, v in raw.items()}
        config = json.loads((folder / "config.json").read_text())
        self.layers = config["num_hidden_layers"]
        self.heads = config["num_attention_heads"]
        self.eps = config["layer_norm_eps"]

    def _dense(self, name: str, x: np.ndarray) -> np.ndarray:
        # einsum's own loop, not BLAS: a BLAS pool beside the engine's oversubscribes 2 cores
        return np.einsum("nd,od->no", x, self.w[name + ".weight"]) + self.w[name + ".bias"]

    def tokens(self, ids: list[int], types: list[int] | None = None) -> np.ndarray:
        """The last layer's token vectors of one unpadded sequence, [length, hidden]."""
        w, n = self.w, len(ids)
        h = (w["embeddings.word_embeddings.weight"][ids]
             + w["embeddings.position_embeddings.weight"][:n]
             + w["embeddings.token_type_embeddings.weight"][types or [0] * n])  # fmt: skip
        h = _layer_norm(
            h, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], self.eps
        )
        for i in range(self.layers):
            p = f"encoder.layer.{i}."
            size = h.shape[1] // self.heads

            def heads(x: np.ndarray, size: int = size) -> np.ndarray:
                return x.reshape(n, self.heads, size).transpose(1, 0, 2)

            q = heads(self._dense(p + "attention.self.query", h))
            k = heads(self._dense(p + "attention.self.key", h))
            v = heads(self._dense(p + "attention.self.value", h))
            scores = np.einsum("hqd,hkd->hqk", q, k) / math.sqrt(size)
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            attn = np.einsum("hqk,hkd->hqd", scores / scores.sum(-1, keepdims=True), v)
            attn = attn.transpose(1, 0, 2).reshape(n, -1)
            h = _layer_norm(self._dense(p + "attention.output.dense", attn) + h,
                            w[p + "attention.output.LayerNorm.weight"],
                            w[p + "attention.output.LayerNorm.bias"], self.eps)  # fmt: skip
            mid = _gelu(self._dense(p + "intermediate.dense", h))
            h = _layer_norm(self._dense(p + "output.dense", mid) + h,
                            w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"],
                            self.eps)  # fmt: skip
        return h

    def relevance(self, ids: list[int], types: list[int]) -> float:
        """A cross-encoder's score: sigmoid(classifier(tanh(pooler([CLS]))))."""
        first = self.tokens(ids, types)[0]
        pooled = np.tanh(self._dense("pooler.dense", first[None]))
        logit = float(self._dense("classifier", pooled)[0, 0])
        return 1 / (1 + math.exp(-logit))

    def embed(self, ids: list[int]) -> np.ndarray:
        """Mean pooling over the tokens, then L2 normalisation (all-MiniLM-L6-v2's modules)."""
        mean = self.tokens(ids).mean(0)
        return mean / np.linalg.norm(mean)


def plain_tokenizer(folder: Path) -> Tokenizer:
    """The folder's tokenizer.json without the fixed padding to 128 it declares."""
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


SENTENCES = [
    "The cat sits outside.",
    "A man is playing guitar.",
    "I love pasta.",
    "The new movie is awesome.",
    "The cat plays in the garden.",
    "A woman watches TV.",
    "The new movie is so great.",
    "Do you like pizza?",
    "Paris is the capital of France.",
    "Berlin is the capital of Germany.",
    "How do I reset my password?",
    "Click 'forgot password' on the login page to reset it.",
    "Photosynthesis turns light into chemical energy.",
    "The mitochondria is the powerhouse of the cell.",
    "Water boils at 100 degrees Celsius at sea level.",
    "Python is a popular programming language.",
    "Rust guarantees memory safety without a garbage collector.",
    "The quick brown fox jumps over the lazy dog.",
    "She sells sea shells by the sea shore.",
    "An apple a day keeps the doctor away.",
    "The stock market fell sharply on Monday.",
    "Interest rates are expected to rise next quarter.",
    "It is raining heavily in Seattle today.",
    "The weather will be sunny and warm tomorrow.",
    "He scored the winning goal in the final minute.",
    "The orchestra performed Beethoven's ninth symphony.",
    "Mount Everest is the highest mountain on Earth.",
    "The Pacific is the largest ocean.",
    "Vaccines train the immune system to fight infections.",
    "Regular exercise improves cardiovascular health.",
    "The library closes at eight in the evening.",
    "Please send the report by Friday.",
    "Our flight was delayed by three hours.",
    "The hotel room had a beautiful view of the sea.",
    "Neural networks learn representations from data.",
    "Embeddings map text to vectors in a shared space.",
    "A reranker scores how well a document answers a query.",
    "Shakespeare wrote Hamlet and Macbeth.",
    "The Great Wall of China is visible from many places.",
    "Coffee contains caffeine, a mild stimulant.",
    "Tea is the most consumed drink after water.",
    "The train to Lyon leaves from platform nine.",
    "My laptop battery drains too quickly.",
    "Try updating the graphics driver to fix the crash.",
    "The museum exhibits paintings from the Renaissance.",
    "Bees are essential pollinators for many crops.",
    "Electric cars are becoming more affordable.",
    "Solar panels convert sunlight into electricity.",
    "x",
    "Supercalifragilisticexpialidocious is a very long word, isn't it? 🙂 naïve café 東京",
]
