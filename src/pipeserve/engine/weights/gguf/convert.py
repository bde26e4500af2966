"""One GGUF file -> one mlx-lm model folder (config.json, model.safetensors, tokenizer).

Metadata, tensor types and the weights are read with gguf-py (llama.cpp's own reader),
one tensor at a time (tensors.py): float types as stored, quantized blocks repacked
exactly as MLX affine arrays where the format allows (Q4_0 ... Q8_0, Q4_K, Q5_K),
re-quantized where it does not (Q2_K, Q3_K, Q6_K), and written in shards as they come
(shards.py). Anything else (the i-quants, ternary types) is refused by name before any
weight is read.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeserve.engine.weights.gguf.architectures import (
    ARCHITECTURES,
    BLOCK_TENSORS,
    CONFIG_KEYS,
    GLOBAL_TENSORS,
    OPTIONAL_CONFIG_KEYS,
    Architecture,
)
from pipeserve.engine.weights.gguf.files import GgufError
from pipeserve.engine.weights.gguf.shards import write_shards
from pipeserve.engine.weights.gguf.tensors import GROUP_SIZE, QUANT_WIDTHS, read_tensor
from pipeserve.engine.weights.gguf.tokenizer import build_tokenizer, tokenizer_config

PLAIN_TYPES: tuple[str, ...] = ("F32", "F16", "BF16")
_QUANT_TYPES = sorted(QUANT_WIDTHS, key=lambda kind: (kind.endswith("_K"), kind))  # K-quants last
SUPPORTED_TYPES = ", ".join((*PLAIN_TYPES, *_QUANT_TYPES))
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(.+)")


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, str], list[Any]]:
    """(metadata, tensor name -> GGUF type name, gguf-py's tensors) of a GGUF file."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # gguf-py raises ValueError / struct errors on bad files
        raise GgufError(f"{path} is not a readable GGUF file: {exc}") from exc
    meta = {name: field.contents() for name, field in reader.fields.items()}
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    return meta, types, list(reader.tensors)


def convert(path: Path, out: Path) -> None:
    """Write the mlx-lm model folder of GGUF `path` into the existing folder `out`."""
    meta, types, tensors = read_gguf(path)
    arch_name = str(meta.get("general.architecture"))
    arch = architecture(arch_name)
    check_tensor_types(types)
    names = {gguf: mlx_name(gguf, arch) for gguf in types}
    tokenizer = build_tokenizer(meta)
    config = model_config(meta, arch_name, arch, names, types)
    write_shards(out, read_weights(tensors, names))
    tokenizer.save(str(out / "tokenizer.json"))
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    _write_json(out / "tokenizer_config.json", tokenizer_config(meta, tokens))
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {"eos_token_id": config["eos_token_id"]})


def architecture(name: str) -> Architecture:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise GgufError(
            f"GGUF architecture {name!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        ) from None


def check_tensor_types(types: dict[str, str]) -> None:
    for name, kind in types.items():
        if kind not in PLAIN_TYPES and kind not in QUANT_WIDTHS:
            raise GgufError(
                f"tensor {name} has GGUF type {kind}, which is not supported "
                f"(supported: {SUPPORTED_TYPES})"
            )


def mlx_name(gguf_name: str, arch: Architecture) -> str:
    """mlx-lm's parameter name (without .weight / .bias) of a GGUF tensor."""
    base = gguf_name.removesuffix(".weight").removesuffix(".bias")
    if base in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[base]
    match = _BLOCK_NAME.fullmatch(base)
    if match:
        layer, local = match.groups()
        mapped = BLOCK_TENSORS.get(local) or arch.extra_block_tensors.get(local)
        if mapped:
            return f"model.layers.{layer}.{mapped}"
    raise GgufError(
        f"tensor {gguf_name} is not known for architecture {arch.model_type} "
        "(rope scaling tables, vision or MoE tensors are not supported)"
    )


def model_config(
    meta: dict[str, Any],
    arch_name: str,
    arch: Architecture,
    names: dict[str, str],
    types: dict[str, str],
) -> dict[str, Any]:
    config: dict[str, Any] = {"model_type": arch.model_type}
    for key, gguf_key in CONFIG_KEYS.items():
        full = f"{arch_name}.{gguf_key}"
        if full not in meta:
            raise GgufError(f"GGUF metadata {full} is missing")
        config[key] = meta[full]
    for key, (gguf_key, default) in OPTIONAL_CONFIG_KEYS.items():
        config[key] = meta.get(f"{arch_name}.{gguf_key}", default)
    if config["head_dim"] is None:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    _check_rope_scaling(meta, arch_name)
    config["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    config["tie_word_embeddings"] = "output.weight" not in types
    config["rope_traditional"] = arch.rope_traditional
    if arch.attention_bias_key:
        config[arch.attention_bias_key] = any(
            n.startswith("blk.") and n.endswith(".attn_q.bias") for n in types
        )
    config["eos_token_id"] = _eos_ids(meta)
    if "tokenizer.ggml.bos_token_id" in meta:
        config["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    quantization = quantization_config(names, types)
    if quantization:
        config["quantization"] = quantization
    return config


def _check_rope_scaling(meta: dict[str, Any], arch_name: str) -> None:
    kind = meta.get(f"{arch_name}.rope.scaling.type")
    if kind not in (None, "none"):
        raise GgufError(f"GGUF rope scaling {kind!r} is not supported")


def _eos_ids(meta: dict[str, Any]) -> list[int]:
    """End-of-sequence and end-of-turn tokens (llama.cpp stops at both)."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = [int(meta[f"tokenizer.ggml.{k}"]) for k in keys if f"tokenizer.ggml.{k}" in meta]
    return list(dict.fromkeys(ids))


def quantization_config(names: dict[str, str], types: dict[str, str]) -> dict[str, Any]:
    """mlx-lm's `quantization`: the most common bit width, other widths per layer."""
    bits = {
        names[n]: QUANT_WIDTHS[t]
        for n, t in types.items()
        if t in QUANT_WIDTHS and n.endswith(".weight")
    }
    if not bits:
        return {}
    common = Counter(bits.values()).most_common(1)[0][0]
    config: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": common}
    for layer, width in sorted(bits.items()):
        if width != common:
            config[layer] = {"group_size": GROUP_SIZE, "bits": width}
    return config


def read_weights(tensors: list[Any], names: dict[str, str]) -> Iterator[tuple[str, Any]]:
    """Every tensor read on its own through gguf-py (tensors.py), one after another."""
    for tensor in tensors:
        for suffix, value in read_tensor(tensor).items():
            part = "bias" if tensor.name.endswith(".bias") else suffix
            yield f"{names[tensor.name]}.{part}", value


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
