"""Tiny GGUF files written with gguf-py's GGUFWriter (random weights, byte-level BPE
vocabulary), to exercise the converter on every architecture and tensor type offline."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quants

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 4, 2, 16, 128, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ 1", "1 2"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokens() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes (bytes_to_unicode)."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    spelled, extra = {}, 0
    for b in range(256):
        if b in printable:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


def vocabulary() -> tuple[list[str], list[int]]:
    tokens = SPECIALS + byte_tokens()
    for merge in MERGES:
        tokens.append(merge.replace(" ", ""))
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    qtype: GGMLQuantizationType = GGMLQuantizationType.Q8_0,
    tied: bool = True,
    pre: str = "smollm",
    seed: int = 0,
    raw_tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
) -> Path:
    """A 2-layer model of `arch` with its matrices stored as `qtype`."""
    rng = np.random.default_rng(seed)
    tokens, types = vocabulary()
    writer = GGUFWriter(str(path), arch)
    for key, value in {
        "block_count": LAYERS, "embedding_length": HIDDEN, "feed_forward_length": FFN,
        "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS,
        "context_length": 512, "attention.key_length": HEAD_DIM,
    }.items():  # fmt: skip
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", pre)
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", types)
    writer.add_array("tokenizer.ggml.merges", MERGES)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.add_uint32("tokenizer.ggml.padding_token_id", 0)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_string("tokenizer.chat_template", TEMPLATE)

    def matrix(name: str, rows: int, cols: int, kind: GGMLQuantizationType = qtype) -> None:
        values = (rng.standard_normal((rows, cols)) * 0.5).astype(np.float32)
        if kind == GGMLQuantizationType.F32:
            writer.add_tensor(name, values)
        elif kind == GGMLQuantizationType.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, quants.quantize(values, kind), raw_dtype=kind)

    def vector(name: str, size: int, around: float = 1.0) -> None:
        writer.add_tensor(name, (around + 0.1 * rng.standard_normal(size)).astype(np.float32))

    matrix("token_embd.weight", len(tokens), HIDDEN)
    for i in range(LAYERS):
        p = f"blk.{i}"
        vector(f"{p}.attn_norm.weight", HIDDEN)
        matrix(f"{p}.attn_q.weight", HEADS * HEAD_DIM, HIDDEN)
        matrix(f"{p}.attn_k.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        matrix(f"{p}.attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        matrix(f"{p}.attn_output.weight", HIDDEN, HEADS * HEAD_DIM)
        if arch == "qwen2":
            vector(f"{p}.attn_q.bias", HEADS * HEAD_DIM, 0.0)
            vector(f"{p}.attn_k.bias", KV_HEADS * HEAD_DIM, 0.0)
            vector(f"{p}.attn_v.bias", KV_HEADS * HEAD_DIM, 0.0)
        if arch == "qwen3":
            vector(f"{p}.attn_q_norm.weight", HEAD_DIM)
            vector(f"{p}.attn_k_norm.weight", HEAD_DIM)
        vector(f"{p}.ffn_norm.weight", HIDDEN)
        matrix(f"{p}.ffn_gate.weight", FFN, HIDDEN)
        matrix(f"{p}.ffn_up.weight", FFN, HIDDEN)
        matrix(f"{p}.ffn_down.weight", HIDDEN, FFN)
    vector("output_norm.weight", HIDDEN)
    if not tied:
        matrix("output.weight", len(tokens), HIDDEN, GGMLQuantizationType.F16)
    for name, (data, kind) in (raw_tensors or {}).items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
