"""What an embedding model does after its encoder: read from the model folder's own
sentence-transformers files (`modules.json`, `1_Pooling/config.json`,
`sentence_bert_config.json`), overridden by the model entry's `embedding:` options."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pipeserve.config.models import EmbeddingOptions

Pooling = Literal["cls", "mean", "last"]
DEFAULT_MAX_LENGTH = 512
ENCODER_TYPES = (
    "bert",
    "xlm-roberta",
    "roberta",
    "nomic_bert",
)  # config.json model_type of encoders
_POOLING_KEYS: tuple[tuple[str, Pooling], ...] = (
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_lasttoken", "last"),
)


@dataclass(frozen=True)
class EmbeddingSpec:
    pooling: Pooling
    normalize: bool
    dimensions: int  # the model's own output size
    matryoshka: bool  # a request may ask for fewer `dimensions` (truncated, renormalised)
    max_length: int  # longest input in tokens (special tokens included)

    def describe(self) -> dict[str, Any]:
        return {
            "pooling": self.pooling,
            "normalize": self.normalize,
            "dimensions": self.dimensions,
            "matryoshka": self.matryoshka,
            "max_length": self.max_length,
        }


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def folder_pooling(model_dir: Path) -> tuple[Pooling | None, bool | None]:
    """(pooling, normalize) as the folder's sentence-transformers modules declare them;
    None for what the folder does not say."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None, None
    modules = json.loads(modules_file.read_text(encoding="utf-8"))
    types = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
    normalize = any(t.endswith(".Normalize") for t in types)
    pooling: Pooling | None = None
    for module in modules:
        if isinstance(module, dict) and str(module.get("type", "")).endswith(".Pooling"):
            config = read_json(model_dir / str(module.get("path", "")) / "config.json")
            pooling = next((mode for key, mode in _POOLING_KEYS if config.get(key)), None)
    return pooling, normalize


def folder_max_length(model_dir: Path, config: dict[str, Any]) -> int:
    st = read_json(model_dir / "sentence_bert_config.json").get("max_seq_length")
    if isinstance(st, int) and st > 0:
        return st
    positions = config.get("max_position_embeddings")
    if config.get("model_type") in ("xlm-roberta", "roberta") and isinstance(positions, int):
        positions -= 2  # their positions start after the padding index
    return int(positions) if isinstance(positions, int) else DEFAULT_MAX_LENGTH


def build_spec(
    model_dir: Path, options: EmbeddingOptions, decoder: bool, hidden_size: int
) -> EmbeddingSpec:
    """The folder's facts, each overridden by the YAML when set there. A decoder without
    sentence-transformers files pools its last token, an encoder its mean."""
    config = read_json(model_dir / "config.json")
    pooling, normalize = folder_pooling(model_dir)
    default_pooling: Pooling = "last" if decoder else "mean"
    return EmbeddingSpec(
        pooling=options.pooling or pooling or default_pooling,
        normalize=options.normalize if options.normalize is not None else normalize is not False,
        dimensions=hidden_size,
        matryoshka=options.matryoshka,
        max_length=options.max_length or folder_max_length(model_dir, config),
    )


def detect_kind(model_dir: Path) -> str | None:
    """`pipeline: auto` on an embedding folder: "embedding" for an encoder or a
    sentence-transformers folder (modules.json), "rerank" for a cross-encoder, None for
    a folder of a generation model. A GGUF file: "embedding" for an encoder architecture
    (BERT: engine/weights/gguf/encoder.py)."""
    if model_dir.suffix == ".gguf" and model_dir.is_file():
        from pipeserve.engine.weights.gguf.files import GgufError
        from pipeserve.engine.weights.gguf.inspect import architecture, open_gguf

        try:
            return "embedding" if architecture(open_gguf(model_dir)).encoder else None
        except GgufError:  # the generation path's checks name what is wrong
            return None
    config = read_json(model_dir / "config.json")
    architectures = [str(a) for a in config.get("architectures") or []]
    if config.get("model_type") in ENCODER_TYPES:
        classifier = any("SequenceClassification" in a for a in architectures)
        return "rerank" if classifier else "embedding"
    return "embedding" if (model_dir / "modules.json").is_file() else None
