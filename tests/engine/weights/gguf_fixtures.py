"""Tiny GGUF files written with gguf-py's GGUFWriter (random weights, a byte-level BPE
or a sentencepiece-style vocabulary), to exercise the converter on every architecture
and tensor type offline.

gguf-py cannot quantize the K types, so `k_quant_rows` writes K blocks directly: random
quant bytes (every bit pattern is a valid block) under float16 super-block scales chosen
so the weights span about +-1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, quants


@dataclass(frozen=True)
class Dims:
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    layers: int = 2


SMALL = Dims()
# K-quant rows hold whole 256-weight super-blocks: every row length a multiple of 256.
K_QUANT = Dims(hidden=256, head_dim=64, ffn=512)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# the `bpe-fim` vocabulary: Qwen2.5-Coder's FIM tokens, control tokens after the merges
FIM_SPECIALS = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                "<|repo_name|>", "<|file_sep|>"]  # fmt: skip
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


T = GGMLQuantizationType
# Byte offsets of the float16 super-block scales (d, then dmin where there is one).
_K_SCALE_OFFSETS = {
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
}


def k_quant_rows(rng: np.random.Generator, kind: T, rows: int, cols: int) -> np.ndarray:
    """`rows` x `cols` weights as raw K blocks (rows x bytes), max |w| about 0.1-0.2
    (small enough that the random model is not chaotic at hidden size 256)."""
    block, size = GGML_QUANT_SIZES[kind]
    count = rows * cols // block
    raw = rng.integers(0, 256, size=(count, size), dtype=np.uint8)

    def set_scales(d: np.ndarray) -> None:
        for offset in _K_SCALE_OFFSETS[kind]:
            raw[:, offset : offset + 2] = d.astype(np.float16).view(np.uint8).reshape(count, 2)

    set_scales(np.ones(count))
    unit = np.abs(quants.dequantize(raw, kind)).max(axis=1)  # linear in the scales
    set_scales(rng.uniform(0.1, 0.2, count) / unit)
    return raw.reshape(rows, cols // block * size)


def spm_vocabulary() -> tuple[list[str], list[int], list[float]]:
    """A sentencepiece-style vocabulary: <unk>, control tokens, the 256 <0xNN> byte
    tokens, then scored pieces ("▁" marks a space; a better score merges first)."""
    specials = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
    chars = list("abcdefghijklmnopqrstuvwxyzTHEW0123456789.,!?'()-:é日本")
    words = ["▁t", "he", "▁the", "in", "▁a", "er", "on", "▁1", "12", "▁▁", "▁▁▁▁", "ll",
             "▁he", "llo", "▁hello", "▁w", "or", "▁wor", "ld", "▁world", "ing", "▁in",
             "ater", "▁theater", "日本", "▁2", "20", "▁(", "x)", "▁is", "▁of"]  # fmt: skip
    pieces = ["▁", *chars, *words]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2] + [3] * (len(specials) - 1) + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(pieces))]
    return tokens, types, scores


def vocabulary(
    specials: tuple[str, ...] = (), extra: tuple[str, ...] = ()
) -> tuple[list[str], list[int]]:
    """ChatML's specials (and `specials` after them), the bytes, a few merges, then the
    `extra` control tokens (at the end, so the ids before them do not move)."""
    special = [*SPECIALS, *specials]
    tokens = special + byte_tokens()
    for merge in MERGES:
        tokens.append(merge.replace(" ", ""))
    types = [3] * len(special) + [1] * (len(tokens) - len(special)) + [3] * len(extra)
    return tokens + list(extra), types


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    qtype: GGMLQuantizationType | Callable[[str], GGMLQuantizationType] = T.Q8_0,
    tied: bool = True,
    pre: str = "smollm",
    seed: int = 0,
    raw_tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
    vocab: str = "bpe",
    dims: Dims = SMALL,
    specials: tuple[str, ...] = (),
) -> Path:
    """A 2-layer model of `arch` with its matrices stored as `qtype` (a type, or a
    function of the tensor name), with a byte-level BPE (`vocab="bpe"`) or a
    sentencepiece-style (`"spm"`) vocabulary."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), arch)
    for key, value in {
        "block_count": dims.layers, "embedding_length": dims.hidden,
        "feed_forward_length": dims.ffn, "attention.head_count": dims.heads,
        "attention.head_count_kv": dims.kv_heads, "context_length": 512,
        "attention.key_length": dims.head_dim,
    }.items():  # fmt: skip
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    tokens = _add_vocabulary(writer, vocab, pre, specials)

    def matrix(name: str, rows: int, cols: int, kind: GGMLQuantizationType | None = None) -> None:
        kind = kind or (qtype(name) if callable(qtype) else qtype)
        if kind in _K_SCALE_OFFSETS:
            writer.add_tensor(name, k_quant_rows(rng, kind, rows, cols), raw_dtype=kind)
            return
        values = (rng.standard_normal((rows, cols)) * 0.5).astype(np.float32)
        if kind == GGMLQuantizationType.F32:
            writer.add_tensor(name, values)
        elif kind == GGMLQuantizationType.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, quants.quantize(values, kind), raw_dtype=kind)

    def vector(name: str, size: int, around: float = 1.0) -> None:
        writer.add_tensor(name, (around + 0.1 * rng.standard_normal(size)).astype(np.float32))

    hidden, q_rows, kv_rows = dims.hidden, dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    matrix("token_embd.weight", len(tokens), hidden)
    for i in range(dims.layers):
        p = f"blk.{i}"
        vector(f"{p}.attn_norm.weight", hidden)
        matrix(f"{p}.attn_q.weight", q_rows, hidden)
        matrix(f"{p}.attn_k.weight", kv_rows, hidden)
        matrix(f"{p}.attn_v.weight", kv_rows, hidden)
        matrix(f"{p}.attn_output.weight", hidden, q_rows)
        if arch == "qwen2":
            vector(f"{p}.attn_q.bias", q_rows, 0.0)
            vector(f"{p}.attn_k.bias", kv_rows, 0.0)
            vector(f"{p}.attn_v.bias", kv_rows, 0.0)
        if arch == "qwen3":
            vector(f"{p}.attn_q_norm.weight", dims.head_dim)
            vector(f"{p}.attn_k_norm.weight", dims.head_dim)
        vector(f"{p}.ffn_norm.weight", hidden)
        matrix(f"{p}.ffn_gate.weight", dims.ffn, hidden)
        matrix(f"{p}.ffn_up.weight", dims.ffn, hidden)
        matrix(f"{p}.ffn_down.weight", hidden, dims.ffn)
    vector("output_norm.weight", hidden)
    if not tied:
        kind = qtype("output.weight") if callable(qtype) else GGMLQuantizationType.F16
        matrix("output.weight", len(tokens), hidden, kind)
    for name, (data, kind) in (raw_tensors or {}).items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_vocabulary(
    writer: GGUFWriter, vocab: str, pre: str, specials: tuple[str, ...] = ()
) -> list[str]:
    if vocab == "spm":  # llama / mistral style: BOS added, no chat template of its own
        tokens, types, scores = spm_vocabulary()
        writer.add_string("tokenizer.ggml.model", "llama")
        writer.add_array("tokenizer.ggml.tokens", tokens)
        writer.add_array("tokenizer.ggml.scores", scores)
        writer.add_array("tokenizer.ggml.token_type", types)
        writer.add_uint32("tokenizer.ggml.unknown_token_id", 0)
        writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
        writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
        return tokens
    tokens, types = vocabulary(specials, tuple(FIM_SPECIALS) if vocab == "bpe-fim" else ())
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
    return tokens
