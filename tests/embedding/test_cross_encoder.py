"""A cross-encoder (BertForSequenceClassification, one label) scores (query, document)
pairs as the numpy reference does: segment ids, the pooler and the classifier head.
No cross-encoder ships in a registry package we found, so this one has random weights
(fixed seed) on all-MiniLM-L6-v2's tokenizer."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from pipeserve.config.models import ModelEntry
from pipeserve.engine.base import ModelRuntime
from pipeserve.engine.embedding.engine import EmbeddingEngine
from pipeserve.engine.embedding.inputs import InputTokenizer
from pipeserve.engine.embedding.jobs import EmbedJob
from pipeserve.engine.embedding.runtime import build_embedding_runtime
from pipeserve.engine.embedding.spec import detect_kind
from tests.embedding.reference import NumpyBert

HIDDEN, LAYERS, INTERMEDIATE, VOCAB = 32, 2, 64, 30522


def tiny_weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    def mat(*shape: int) -> np.ndarray:
        return rng.normal(0, 0.2, shape).astype(np.float32)

    w = {
        "bert.embeddings.word_embeddings.weight": mat(VOCAB, HIDDEN),
        "bert.embeddings.position_embeddings.weight": mat(128, HIDDEN),
        "bert.embeddings.token_type_embeddings.weight": mat(2, HIDDEN),
        "bert.embeddings.LayerNorm.weight": 1 + mat(HIDDEN),
        "bert.embeddings.LayerNorm.bias": mat(HIDDEN),
        "bert.pooler.dense.weight": mat(HIDDEN, HIDDEN),
        "bert.pooler.dense.bias": mat(HIDDEN),
        "classifier.weight": mat(1, HIDDEN),
        "classifier.bias": mat(1),
    }
    shapes = {"attention.self.query": (HIDDEN, HIDDEN), "attention.self.key": (HIDDEN, HIDDEN),
              "attention.self.value": (HIDDEN, HIDDEN), "attention.output.dense": (HIDDEN, HIDDEN),
              "intermediate.dense": (INTERMEDIATE, HIDDEN), "output.dense": (HIDDEN, INTERMEDIATE)}  # fmt: skip
    for i in range(LAYERS):
        p = f"bert.encoder.layer.{i}."
        for name, shape in shapes.items():
            w[p + name + ".weight"], w[p + name + ".bias"] = mat(*shape), mat(shape[0])
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            w[p + norm + ".weight"], w[p + norm + ".bias"] = 1 + mat(HIDDEN), mat(HIDDEN)
    return w


@pytest.fixture(scope="module")
def folder(minilm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cross-encoder")
    shutil.copy(minilm_dir / "tokenizer.json", out / "tokenizer.json")
    config = {"architectures": ["BertForSequenceClassification"], "model_type": "bert",
              "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
              "num_attention_heads": 4, "intermediate_size": INTERMEDIATE,
              "max_position_embeddings": 128, "type_vocab_size": 2, "layer_norm_eps": 1e-12,
              "id2label": {"0": "LABEL_0"}}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    save_file(tiny_weights(np.random.default_rng(7)), str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def runtime(folder: Path) -> Iterator[ModelRuntime]:
    entry = ModelEntry(name="ce", source=str(folder), kind="rerank")
    built = build_embedding_runtime(entry, folder)
    yield built
    built.engine.close()


def test_cross_encoder_scores_match_the_reference(folder: Path, runtime: ModelRuntime) -> None:
    assert detect_kind(folder) == "rerank"
    tokenizer, engine = runtime.tokenizer, runtime.engine
    assert isinstance(tokenizer, InputTokenizer) and isinstance(engine, EmbeddingEngine)
    documents = [
        "Paris is the capital of France.",
        "Bananas are yellow.",
        "A much longer document " * 5,
    ]
    pairs = tokenizer.pairs("What is the capital of France?", documents, truncate=False)
    assert all(1 in seq.types for seq in pairs if seq.types is not None)  # the document's segment
    result = engine.embed(EmbedJob("t", pairs, mode="score")).wait(60)
    assert result is not None and result.error is None
    reference = NumpyBert(folder)
    for seq, score in zip(pairs, result.scores, strict=True):
        assert seq.types is not None
        assert abs(score - reference.relevance(seq.ids, seq.types)) < 1e-4
    assert len(set(round(s, 4) for s in result.scores)) == 3  # the pairs are told apart
