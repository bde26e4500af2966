"""A tiny random-weight BERT GGUF as llama.cpp's converter writes one (architecture
`bert`, a WordPiece vocabulary in phantom-space form, F32 tables and norms, F16 or
Q8_0 matrices), or a nomic-bert one (rotary positions, one q/k/v matrix, a SwiGLU
feed-forward, no biases), for the encoder GGUF tests."""

from __future__ import annotations

import unicodedata
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, PoolingType, TokenType, quants

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["the", "a", "is", "of", "and", "to", "in", "quick", "brown", "fox", "report",
         "cat", "dog", "play", "weather", "today", "send", "friday"]  # fmt: skip
SUFFIXES = ["ing", "ed", "s", "er", "ly", "tion"]
HIDDEN, HEADS, FFN, LAYERS, CONTEXT = 64, 4, 128, 2, 128


def vocabulary(texts: list[str]) -> list[str]:
    """Phantom-space pieces: specials, every character of `texts` (lower-cased, NFD) as a
    word start and as a continuation, some whole words and suffixes."""
    chars = sorted({c for t in texts for c in unicodedata.normalize("NFD", t.lower())
                    if not c.isspace()})  # fmt: skip
    pieces = [f"\u2581{c}" for c in chars] + chars
    pieces += [f"\u2581{w}" for w in WORDS] + SUFFIXES
    seen: dict[str, None] = dict.fromkeys(SPECIALS)
    for piece in pieces:
        seen.setdefault(piece, None)
    return list(seen)


def write_bert_gguf(path: Path, texts: list[str], matrix_type: GGMLQuantizationType,
                    pooling: int = 1, seed: int = 0, arch: str = "bert") -> Path:  # fmt: skip
    """pooling: llama.cpp's pooling type (1 mean, 2 cls); arch: bert or nomic-bert."""
    rng = np.random.default_rng(seed)
    tokens = vocabulary(texts)
    nomic = arch == "nomic-bert"
    writer = GGUFWriter(str(path), arch)
    if nomic:
        writer.add_rope_freq_base(1000.0)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_layer_norm_eps(1e-12)
    writer.add_causal_attention(False)
    writer.add_pooling_type(PoolingType(pooling))
    writer.add_file_type(1 if matrix_type == GGMLQuantizationType.F16 else 7)
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    kinds = [TokenType.CONTROL if t in SPECIALS else TokenType.NORMAL for t in tokens]
    writer.add_token_types(kinds)
    writer.add_token_type_count(2)
    writer.add_bos_token_id(2)
    writer.add_sep_token_id(3)
    writer.add_unk_token_id(1)
    writer.add_pad_token_id(0)
    writer.add_mask_token_id(4)
    writer.add_add_bos_token(True)
    writer.add_add_sep_token(True)

    def small(*shape: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm(name: str) -> None:
        writer.add_tensor(f"{name}.weight", (1 + small(HIDDEN, scale=0.1)).astype(np.float32))
        writer.add_tensor(f"{name}.bias", small(HIDDEN, scale=0.05))

    def linear(name: str, rows: int, cols: int) -> None:
        weight = small(rows, cols)
        if matrix_type == GGMLQuantizationType.F16:
            writer.add_tensor(f"{name}.weight", weight.astype(np.float16))
        else:
            data = quants.quantize(weight, matrix_type)
            writer.add_tensor(f"{name}.weight", data, raw_dtype=matrix_type)
        if not nomic:
            writer.add_tensor(f"{name}.bias", small(rows, scale=0.02))

    writer.add_tensor("token_embd.weight", small(len(tokens), HIDDEN, scale=0.5))
    writer.add_tensor("token_types.weight", small(2, HIDDEN, scale=0.1))
    if not nomic:
        writer.add_tensor("position_embd.weight", small(CONTEXT, HIDDEN, scale=0.1))
    norm("token_embd_norm")
    for layer in range(LAYERS):
        p = f"blk.{layer}"
        if nomic:
            linear(f"{p}.attn_qkv", 3 * HIDDEN, HIDDEN)
        for part in ("attn_output",) if nomic else ("attn_q", "attn_k", "attn_v", "attn_output"):
            linear(f"{p}.{part}", HIDDEN, HIDDEN)
        norm(f"{p}.attn_output_norm")
        if nomic:
            linear(f"{p}.ffn_gate", FFN, HIDDEN)
        linear(f"{p}.ffn_up", FFN, HIDDEN)
        linear(f"{p}.ffn_down", HIDDEN, FFN)
        norm(f"{p}.layer_output_norm")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
