"""One GGUF file -> one mlx-lm model folder (config.json, model.safetensors, tokenizer);
an encoder (BERT) file -> a Hugging Face BERT folder (encoder.py).

Metadata, tensor types and the weights are read with gguf-py (llama.cpp's own reader),
one tensor at a time (tensors.py): float types as stored, quantized blocks repacked
exactly as MLX affine arrays where the format allows (Q4_0 ... Q8_0, Q4_K, Q5_K),
re-quantized where it does not (Q2_K, Q3_K, Q6_K), and written in shards as they come
(shards.py). Anything else (the i-quants, ternary types), an unknown architecture, a
tokenizer not in the table or a tensor whose size does not match its shape is refused
by name before any weight is read (inspect.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pipeserve.engine.weights.gguf.architectures import (
    BLOCK_TENSORS,
    CONFIG_TENSORS,
    GLOBAL_TENSORS,
    PARAMETER_TENSORS,
    ROW_VECTORS,
    Architecture,
)
from pipeserve.engine.weights.gguf.files import GgufError
from pipeserve.engine.weights.gguf.inspect import check_convertible, open_gguf
from pipeserve.engine.weights.gguf.model_config import model_config
from pipeserve.engine.weights.gguf.shards import write_shards
from pipeserve.engine.weights.gguf.tensors import read_tensor
from pipeserve.engine.weights.gguf.tokenizer import build_tokenizer, tokenizer_config

_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(.+)")
_NORM = re.compile(r"(^|\.)(\w*norm)$")


def gguf_tensors(path: Path) -> list[Any]:
    """gguf-py's tensors of a GGUF file (memory-mapped data, read one at a time)."""
    from gguf import GGUFReader

    try:
        return list(GGUFReader(str(path)).tensors)
    except Exception as exc:  # the header was read (inspect.py): the data is what is wrong
        raise GgufError(f"{path}: its tensors cannot be read ({exc})") from None


def convert(path: Path, out: Path) -> None:
    """Write the mlx-lm model folder of GGUF `path` into the existing folder `out`."""
    file = open_gguf(path)
    arch = check_convertible(file)
    if arch.encoder:
        from pipeserve.engine.weights.gguf.encoder import convert_encoder

        convert_encoder(file.meta, file.architecture_name, gguf_tensors(path), out)
        return
    meta, types = file.meta, file.types
    names = {gguf: mlx_name(gguf, arch) for gguf in types if gguf not in CONFIG_TENSORS}
    tokenizer = build_tokenizer(meta)
    tensors = gguf_tensors(path)
    rope = _config_tensors(tensors)
    config = model_config(meta, file.architecture_name, arch, names, types, rope)
    write_shards(out, read_weights(tensors, names, arch, config))
    tokenizer.save(str(out / "tokenizer.json"))
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    _write_json(out / "tokenizer_config.json", tokenizer_config(meta, tokens))
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {"eos_token_id": config["eos_token_id"]})


def _config_tensors(tensors: list[Any]) -> dict[str, np.ndarray]:
    """The rope tensors config.json takes (CONFIG_TENSORS), by name without `.weight`."""
    return {
        tensor.name.removesuffix(".weight"): np.asarray(tensor.data, dtype=np.float32).reshape(-1)
        for tensor in tensors
        if tensor.name in CONFIG_TENSORS
    }


def mlx_name(gguf_name: str, arch: Architecture) -> str:
    """mlx-lm's parameter name (without .weight / .bias) of a GGUF tensor."""
    base = gguf_name.removesuffix(".weight").removesuffix(".bias")
    if base in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[base]
    match = _BLOCK_NAME.fullmatch(base)
    if match:
        layer, local = match.groups()
        mapped = arch.block_tensors.get(local) or BLOCK_TENSORS.get(local)
        if mapped:
            return f"model.layers.{layer}.{mapped}"
    raise GgufError(
        f"tensor {gguf_name} is not known for architecture {arch.model_type} "
        "(vision, audio or other extra tensors are not supported)"
    )


def read_weights(
    tensors: list[Any], names: dict[str, str], arch: Architecture, config: dict[str, Any]
) -> Iterator[tuple[str, Any]]:
    """Every tensor read on its own through gguf-py (tensors.py), one after another."""
    for tensor in tensors:
        if tensor.name not in names:
            continue
        arrays = read_tensor(tensor)
        arrays = _adjusted(tensor.name, names[tensor.name], arrays, arch, config)
        if tensor.name.endswith(PARAMETER_TENSORS):
            yield names[tensor.name], arrays["weight"]
            continue
        for suffix, value in arrays.items():
            part = "bias" if tensor.name.endswith(".bias") else suffix
            yield f"{names[tensor.name]}.{part}", value


def _adjusted(
    gguf_name: str, name: str, arrays: dict[str, Any], arch: Architecture, config: dict[str, Any]
) -> dict[str, Any]:
    """Undo what llama.cpp's converter did to a tensor that mlx-lm does not expect."""
    if gguf_name.endswith(ROW_VECTORS):  # a 1-output Linear stored as a vector
        return {"weight": arrays["weight"].reshape(1, -1)}
    if arch.norms_plus_one and _NORM.search(name) and gguf_name.endswith(".weight"):
        return {"weight": arrays["weight"] - 1.0}
    if arch.rope == "unpermute" and gguf_name.endswith((".attn_q.weight", ".attn_k.weight")):
        key = "num_attention_heads" if ".attn_q." in gguf_name else "num_key_value_heads"
        return {k: unpermute_rows(v, int(config[key])) for k, v in arrays.items()}
    return arrays


def unpermute_rows(rows: Any, heads: int) -> Any:
    """The inverse of llama.cpp's Q/K row permutation (convert_hf_to_gguf.py `permute`):
    each head's rows back from (pairs, 2) interleaved to (2, pairs) halves."""
    shape = rows.shape
    per_head = shape[0] // heads
    split = rows.reshape(heads, per_head // 2, 2, *shape[1:])
    return split.swapaxes(1, 2).reshape(shape)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
