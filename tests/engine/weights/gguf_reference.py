r"""Independent references for GGUF models, sharing no code with pipeserve's converter.

- `NumpyLlama`: a float32 numpy forward pass (llama / qwen2 / qwen3) on weights that
  gguf-py (llama.cpp's Python package) dequantizes, with llama.cpp's rope conventions:
  llama runs rope on adjacent pairs ("NORM" mode, llama.cpp stores its Q/K rows for
  that), qwen2 / qwen3 on halves ("NEOX" mode).
- `transformers_tokenizer`: transformers' own GGUF tokenizer builder, fed the
  `tokenizer.ggml.*` metadata as gguf-py reads it (transformers' GGUF file reader needs
  torch, its tokenizer builder does not). transformers 5.x has no split for
  `tokenizer.ggml.pre` "smollm" and falls back to GPT-2's; llama.cpp splits such
  vocabularies at every digit first (its regex list for smollm / starcoder starts with
  `\p{N}`, as SmolLM2's own tokenizer.json has a Digits step). `llama_cpp_splits` adds
  that first split in front of transformers' pre-tokenizer. For sentencepiece-style
  (`llama`) vocabularies transformers prepends "▁" with a Metaspace pre-tokenizer (at the
  start only, and not before a leading space); llama.cpp puts one before every piece of
  text between special tokens, as sentencepiece does: `llama_cpp_splits` swaps in that
  rule, the same normalizer transformers' own phi3 builder uses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

ROPE_MODE = {"llama": "norm", "qwen2": "neox", "qwen3": "neox"}
LLAMA_CPP_FIRST_SPLIT = {"smollm": r"\p{N}", "starcoder": r"\p{N}"}


def read_metadata(path: Path) -> tuple[dict[str, Any], Any]:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return {name: field.contents() for name, field in reader.fields.items()}, reader


def transformers_tokenizer(path: Path, llama_cpp_splits: bool = True) -> Any:
    """transformers' tokenizer for the GGUF (a `tokenizers.Tokenizer`)."""
    from tokenizers import Regex, normalizers, pre_tokenizers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    meta, _ = read_metadata(path)
    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    spec = {
        name: meta[f"tokenizer.{key}"]
        for key, name in renames.items()
        if f"tokenizer.{key}" in meta
    }
    backend, _ = convert_gguf_tokenizer(meta["general.architecture"], spec)
    if llama_cpp_splits and spec.get("tokenizer_type") == "llama":
        prefix = [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
        backend.normalizer = normalizers.Sequence(prefix)
        backend.pre_tokenizer = None
    first = LLAMA_CPP_FIRST_SPLIT.get(spec.get("pre_tokenizer_type", ""))
    if llama_cpp_splits and first:
        split = pre_tokenizers.Split(Regex(first), behavior="isolated")
        backend.pre_tokenizer = pre_tokenizers.Sequence([split, backend.pre_tokenizer])
    return backend


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


class NumpyLlama:
    """Causal forward passes over whole sequences, all in float32."""

    def __init__(self, path: Path) -> None:
        from gguf import dequantize

        meta, reader = read_metadata(path)
        arch = meta["general.architecture"]
        self.rope = ROPE_MODE[arch]

        def key(name: str) -> Any:
            return meta[f"{arch}.{name}"]

        self.layers = int(key("block_count"))
        self.heads = int(key("attention.head_count"))
        self.kv_heads = int(key("attention.head_count_kv"))
        self.eps = float(key("attention.layer_norm_rms_epsilon"))
        self.base = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
        hidden = int(key("embedding_length"))
        self.head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // self.heads))
        self.w: dict[str, np.ndarray] = {}
        for tensor in reader.tensors:
            values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            shape = tuple(int(d) for d in reversed(tensor.shape))
            self.w[tensor.name] = values.reshape(shape)
        self.w.setdefault("output.weight", self.w["token_embd.weight"])

    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        out = x @ self.w[f"{name}.weight"].T
        bias = self.w.get(f"{name}.bias")
        return out if bias is None else out + bias

    def _rope(self, x: np.ndarray) -> np.ndarray:
        """x: heads x T x head_dim, rotated by each row's position."""
        d = self.head_dim
        positions = np.arange(x.shape[1], dtype=np.float64)[:, None]
        freqs = positions * self.base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        cos, sin = np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)
        if self.rope == "norm":
            a, b = x[..., 0::2], x[..., 1::2]
            out = np.empty_like(x)
            out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
            return out
        a, b = x[..., : d // 2], x[..., d // 2 :]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    def _heads(self, x: np.ndarray, count: int) -> np.ndarray:
        return x.reshape(x.shape[0], count, self.head_dim).transpose(1, 0, 2)

    def forward(self, tokens: list[int]) -> np.ndarray:
        """Logits (T x vocab) at every position of `tokens` (causal attention)."""
        x = self.w["token_embd.weight"][np.asarray(tokens)]
        length = len(tokens)
        mask = np.triu(np.full((length, length), -np.inf, dtype=np.float32), k=1)
        group = self.heads // self.kv_heads
        for i in range(self.layers):
            p = f"blk.{i}"
            h = _rms_norm(x, self.w[f"{p}.attn_norm.weight"], self.eps)
            q = self._heads(self._linear(h, f"{p}.attn_q"), self.heads)
            k = self._heads(self._linear(h, f"{p}.attn_k"), self.kv_heads)
            v = self._heads(self._linear(h, f"{p}.attn_v"), self.kv_heads)
            if f"{p}.attn_q_norm.weight" in self.w:
                q = _rms_norm(q, self.w[f"{p}.attn_q_norm.weight"], self.eps)
                k = _rms_norm(k, self.w[f"{p}.attn_k_norm.weight"], self.eps)
            q, k = self._rope(q), self._rope(k)
            k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
            scores = q @ k.transpose(0, 2, 1) / np.float32(np.sqrt(self.head_dim)) + mask
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            scores /= scores.sum(axis=-1, keepdims=True)
            attn = (scores @ v).transpose(1, 0, 2).reshape(length, -1)
            x = x + self._linear(attn, f"{p}.attn_output")
            h = _rms_norm(x, self.w[f"{p}.ffn_norm.weight"], self.eps)
            gate = self._linear(h, f"{p}.ffn_gate")
            up = self._linear(h, f"{p}.ffn_up")
            x = x + self._linear(gate / (1 + np.exp(-gate)) * up, f"{p}.ffn_down")
        x = _rms_norm(x, self.w["output_norm.weight"], self.eps)
        return x @ self.w["output.weight"].T

    def greedy_agrees(self, prompt: list[int], generated: list[int]) -> tuple[int, np.ndarray]:
        """How many leading `generated` tokens are this model's own greedy choices, and
        the logits it picked them from (one forward pass over prompt + generated: when
        all agree, greedy decoding here gives exactly `generated`)."""
        logits = self.forward(prompt + generated)[len(prompt) - 1 : -1]
        picks = np.argmax(logits, axis=-1)
        agree = 0
        while agree < len(generated) and picks[agree] == generated[agree]:
            agree += 1
        return agree, logits
