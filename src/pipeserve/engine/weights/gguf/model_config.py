"""config.json of a converted GGUF: the architecture's keys (architectures.py) read
from the file's `<architecture>.*` metadata, rope scaling, tying, EOS / BOS ids and
mlx-lm's `quantization` section."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np

from pipeserve.engine.weights.gguf.architectures import CONFIG_KEYS, REQUIRED, Architecture
from pipeserve.engine.weights.gguf.files import GgufError
from pipeserve.engine.weights.gguf.tensors import GROUP_SIZE, MODES, QUANT_WIDTHS

# Llama 3.x rope scaling: llama.cpp's converter writes the per-frequency divisors as the
# tensor rope_freqs.weight; Meta's parameters other than the factor are these for every
# Llama 3.1 / 3.2 / 3.3 release. The divisors must match them (else refused).
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip


def model_config(
    meta: dict[str, Any],
    arch_name: str,
    arch: Architecture,
    names: dict[str, str],
    types: dict[str, str],
    rope_tensors: dict[str, np.ndarray] | None = None,
) -> dict[str, Any]:
    """`rope_tensors`: the file's rope_freqs / rope_factors_long / rope_factors_short
    (names without `.weight`), which become rope scaling here."""
    config: dict[str, Any] = {"model_type": arch.model_type}
    for key, (gguf_key, default) in {**CONFIG_KEYS, **arch.config}.items():
        full = f"{arch_name}.{gguf_key}"
        if full in meta:
            config[key] = meta[full]
        elif default is REQUIRED:
            raise GgufError(f"GGUF metadata {full} is missing")
        elif default is not None:
            config[key] = default
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    if config.get("head_dim") is None:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    config.update(arch.constants)
    for key in arch.head_dim_keys:
        config[key] = config["head_dim"]
    _sliding_window(config, arch)
    _rope(config, meta, arch_name, arch, rope_tensors or {})
    config["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    config["tie_word_embeddings"] = "output.weight" not in types
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


def _sliding_window(config: dict[str, Any], arch: Architecture) -> None:
    """Only an mlx-lm class that places its own sliding layers (Gemma) gets a window."""
    if not arch.own_window_pattern:
        config.pop("sliding_window", None)


def _rope(
    config: dict[str, Any],
    meta: dict[str, Any],
    arch_name: str,
    arch: Architecture,
    tensors: dict[str, np.ndarray],
) -> None:
    if arch.rope == "traditional":
        config["rope_traditional"] = True
    dims = meta.get(f"{arch_name}.rope.dimension_count")
    if dims is not None and int(dims) != config["head_dim"]:
        config["partial_rotary_factor"] = int(dims) / config["head_dim"]
    kind = meta.get(f"{arch_name}.rope.scaling.type")
    factor = meta.get(f"{arch_name}.rope.scaling.factor")
    if "rope_freqs" in tensors:
        config["rope_scaling"] = llama3_scaling(tensors["rope_freqs"], config)
    elif "rope_factors_long" in tensors:
        config.update(_longrope(meta, arch_name, arch, tensors, config))
    elif kind == "linear" and factor:
        config["rope_scaling"] = {"type": "linear", "factor": float(factor)}
    elif kind == "yarn" and factor:
        config["rope_scaling"] = _yarn(meta, arch_name, float(factor))
    elif kind not in (None, "none"):
        raise GgufError(
            f"GGUF rope scaling {kind!r} is not supported (supported: linear, llama3, yarn)"
        )


def _longrope(meta: dict[str, Any], arch_name: str, arch: Architecture,
              tensors: dict[str, np.ndarray], config: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """Phi-3's longrope (rope_factors_long / _short and the attention factor) as mlx-lm's
    `longrope` rope scaling (SuScaledRoPE). mlx-lm rotates every position with the long
    factors, as llama.cpp does where its context exceeds the original one (with a context
    at most that long llama.cpp takes the short factors); SuScaledRoPE derives the
    attention factor from the two context lengths, which must give the file's."""
    key = f"{arch_name}.rope.scaling"
    if arch.model_type != "phi3":
        raise GgufError(f"GGUF rope_factors_long.weight is not supported for {arch_name}")
    original = meta.get(f"{key}.original_context_length")
    short = tensors.get("rope_factors_short")
    if original is None or short is None:
        raise GgufError(f"GGUF longrope: {key}.original_context_length or "
                        "rope_factors_short.weight is missing")  # fmt: skip
    long = tensors["rope_factors_long"]
    ratio = config["max_position_embeddings"] / int(original)
    derived = math.sqrt(1 + math.log(ratio) / math.log(int(original))) if ratio > 1 else 1.0
    stored = float(meta.get(f"{key}.attn_factor", 1.0))
    if not math.isclose(derived, stored, rel_tol=1e-5):
        raise GgufError(f"GGUF longrope: attention factor {stored:g} is not the one the "
                        f"context lengths give ({derived:g}); not supported")  # fmt: skip
    return {
        "original_max_position_embeddings": int(original),
        "rope_scaling": {"type": "longrope", "long_factor": long.tolist(),
                         "short_factor": short.tolist()},
    }  # fmt: skip


def _yarn(meta: dict[str, Any], arch_name: str, factor: float) -> dict[str, Any]:
    """mlx-lm's `yarn` rope scaling from llama.cpp's keys (gpt-oss)."""
    key = f"{arch_name}.rope.scaling"
    original = meta.get(f"{key}.original_context_length")
    if original is None:
        raise GgufError(f"GGUF metadata {key}.original_context_length is missing (yarn)")
    return {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": int(original),
        "beta_fast": float(meta.get(f"{key}.yarn_beta_fast", 32.0)),
        "beta_slow": float(meta.get(f"{key}.yarn_beta_slow", 1.0)),
    }


def llama3_scaling(divisors: np.ndarray, config: dict[str, Any]) -> dict[str, Any]:
    """mlx-lm's `llama3` rope scaling whose frequencies are the file's rope_freqs."""
    factor = float(divisors.max())
    scaling = {"rope_type": "llama3", "factor": factor, **LLAMA3_ROPE}
    expected = llama3_divisors(int(config["head_dim"]), float(config["rope_theta"]), scaling)
    if expected.shape != divisors.shape or not np.allclose(expected, divisors, rtol=1e-4):
        raise GgufError(
            "GGUF rope_freqs.weight is not Llama 3's rope scaling (factor "
            f"{factor:g}, low 1, high 4, original context 8192); not supported"
        )
    return scaling


def llama3_divisors(dims: int, base: float, scaling: dict[str, Any]) -> np.ndarray:
    """The per-frequency divisors of Llama 3's rope scaling (as llama.cpp's converter)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    freqs = 1.0 / base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    wavelens = 2 * np.pi / freqs
    smooth = (old / wavelens - low) / (high - low)
    divisors = np.where(wavelens < old / high, 1.0, 1.0 / ((1 - smooth) / factor + smooth))
    return np.where(wavelens > old / low, factor, divisors).astype(np.float32)


def _eos_ids(meta: dict[str, Any]) -> list[int]:
    """End-of-sequence and end-of-turn tokens (llama.cpp stops at both)."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = [int(meta[f"tokenizer.ggml.{k}"]) for k in keys if f"tokenizer.ggml.{k}" in meta]
    return list(dict.fromkeys(ids))


def quantization_config(names: dict[str, str], types: dict[str, str]) -> dict[str, Any]:
    """mlx-lm's `quantization`: the most common bit width, other widths per layer."""
    kinds = {names[n]: t for n, t in types.items() if t in QUANT_WIDTHS and n.endswith(".weight")}
    if not kinds:
        return {}
    common = Counter(kinds.values()).most_common(1)[0][0]
    config: dict[str, Any] = _layer_quantization(common)
    for layer, kind in sorted(kinds.items()):
        if _layer_quantization(kind) != config:
            config[layer] = _layer_quantization(kind)
    return config


def _layer_quantization(kind: str) -> dict[str, Any]:
    found: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": QUANT_WIDTHS[kind]}
    if kind in MODES:
        found["mode"] = MODES[kind]
    return found
