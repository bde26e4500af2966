"""A BERT-style encoder GGUF (llama.cpp's `bert` architecture: all-MiniLM, bge, e5 files
made by its converter; `nomic-bert`: nomic-embed-text) -> a Hugging Face BERT folder the
embedding engine loads (engine/embedding/bert.py): config.json, model.safetensors under
BERT's own tensor names, a WordPiece tokenizer.json (wordpiece.py) and
sentence-transformers' pooling files from the file's `<arch>.pooling_type`.

nomic-bert differs as llama.cpp's graph does: rotary positions (NeoX style, the file's
`rope.freq_base`) instead of learned ones, q, k and v in one matrix (split here), a
SwiGLU feed-forward (`ffn_gate`), no biases (zeros written, the same network).

Every weight is dequantized to float32 with gguf-py (llama.cpp's own reader): the
encoder runs in float32 (bert.py), and these files are small (22-335 M parameters).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pipeserve.engine.weights.gguf.files import GgufError

_GLOBAL = {
    "token_embd": "embeddings.word_embeddings",
    "position_embd": "embeddings.position_embeddings",
    "token_types": "embeddings.token_type_embeddings",
    "token_embd_norm": "embeddings.LayerNorm",
}
_BLOCK = {
    "attn_q": "attention.self.query",
    "attn_k": "attention.self.key",
    "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense",
    "attn_output_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense",
    "ffn_gate": "intermediate.gate",
    "ffn_down": "output.dense",
    "layer_output_norm": "output.LayerNorm",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_QKV = "attn_qkv"  # nomic-bert's q, k and v rows in one tensor
_LINEARS = ("attention.self.query", "attention.self.key", "attention.self.value",
            "attention.output.dense", "intermediate.dense", "intermediate.gate", "output.dense")  # fmt: skip
# llama.cpp's pooling_type numbers -> sentence-transformers' pooling mode
_POOLING = {1: "pooling_mode_mean_tokens", 2: "pooling_mode_cls_token", 3: "pooling_mode_lasttoken"}


def bert_name(gguf_name: str) -> str:
    """The Hugging Face BERT parameter name of a GGUF tensor (GgufError if unknown)."""
    base, _, part = gguf_name.rpartition(".")
    if base in _GLOBAL and part in ("weight", "bias"):
        return f"{_GLOBAL[base]}.{part}"
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match and match.group(2) == _QKV:
        return f"encoder.layer.{match.group(1)}.{_QKV}.{match.group(3)}"  # split on reading
    if match and match.group(2) in _BLOCK:
        layer, local, part = match.groups()
        return f"encoder.layer.{layer}.{_BLOCK[local]}.{part}"
    raise GgufError(
        f"tensor {gguf_name} is not known for an encoder (bert, nomic-bert): a classifier "
        "head or another encoder's tensors are not supported"
    )


def encoder_config(
    meta: dict[str, Any], arch: str, vocab_size: int, type_count: int
) -> dict[str, Any]:
    def number(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise GgufError(f"the file has no {arch}.{key}")
        return value

    config = {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "vocab_size": vocab_size,
        "hidden_size": int(number("embedding_length")),
        "num_hidden_layers": int(number("block_count")),
        "num_attention_heads": int(number("attention.head_count")),
        "intermediate_size": int(number("feed_forward_length")),
        "max_position_embeddings": int(number("context_length")),
        "type_vocab_size": type_count,
        "layer_norm_eps": float(number("attention.layer_norm_epsilon", 1e-12)),
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id", 0)),
        "hidden_act": "gelu",
    }
    if arch == "nomic-bert":
        config.update(model_type="nomic_bert", hidden_act="swiglu",
                      rotary_emb_base=float(number("rope.freq_base", 10000.0)))  # fmt: skip
    return config


def encoder_weights(tensors: list[Any]) -> Iterator[tuple[str, Any]]:
    """(BERT name, float32 array) per tensor, one dequantized at a time; a fused q/k/v
    split in three; a zero bias for each linear layer the file has none for."""
    import mlx.core as mx
    from gguf import quants

    names = {bert_name(t.name) for t in tensors}
    for tensor in tensors:
        name = bert_name(tensor.name)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        values = np.asarray(quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
        values = values.reshape(shape)
        if f".{_QKV}." in name:
            base, part = name.split(f".{_QKV}.")
            for which, rows in zip(("query", "key", "value"), np.split(values, 3), strict=True):
                yield f"{base}.attention.self.{which}.{part}", mx.array(rows)
                if part == "weight" and f"{base}.{_QKV}.bias" not in names:
                    yield f"{base}.attention.self.{which}.bias", mx.zeros((rows.shape[0],))
            continue
        yield name, mx.array(values)
        linear = name.removesuffix(".weight")
        if name.endswith(".weight") and linear.endswith(_LINEARS) and f"{linear}.bias" not in names:
            yield f"{linear}.bias", mx.zeros((shape[0],), mx.float32)


def convert_encoder(meta: dict[str, Any], arch: str, tensors: list[Any], out: Path) -> None:
    """Write the BERT folder of an encoder GGUF (its metadata, architecture name and
    gguf-py tensors) into the existing folder `out`; its tensor names were checked with
    the file (inspect.check_convertible)."""
    from pipeserve.engine.weights.gguf.shards import write_shards
    from pipeserve.engine.weights.gguf.wordpiece import build_wordpiece, wordpiece_config

    types = next((t for t in tensors if t.name == "token_types.weight"), None)
    type_count = int(types.shape[1]) if types is not None and len(types.shape) > 1 else 1
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    config = encoder_config(meta, arch, len(tokens), type_count)
    write_shards(out, encoder_weights(tensors))
    build_wordpiece(meta).save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", wordpiece_config(meta))
    _write_json(out / "config.json", config)
    _write_pooling(out, meta, arch, config["hidden_size"])


def _write_pooling(out: Path, meta: dict[str, Any], arch: str, width: int) -> None:
    """sentence-transformers' modules.json and 1_Pooling/config.json from the file's
    pooling type (mean when it names none, as llama.cpp's bert graph does)."""
    key = _POOLING.get(int(meta.get(f"{arch}.pooling_type", 1)))
    if key is None:
        raise GgufError(f"{arch}.pooling_type {meta.get(f'{arch}.pooling_type')} is not supported")
    (out / "1_Pooling").mkdir(exist_ok=True)
    _write_json(out / "1_Pooling" / "config.json", {"word_embedding_dimension": width, key: True})
    # Normalised, as llama.cpp's server and Ollama answer by default (the file cannot
    # say); a model entry's `embedding.normalize: false` turns it off.
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    _write_json(out / "modules.json", modules)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False))
