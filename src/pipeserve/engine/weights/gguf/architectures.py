"""What each supported GGUF architecture becomes in mlx-lm: model type, config keys,
tensor names and rope layout. Data only; convert.py reads it.

llama.cpp's converter permutes the Q/K rows of llama models for its interleaved
("traditional") rope, so a llama GGUF runs in mlx-lm with `rope_traditional: true`
on the weights as stored. qwen2 / qwen3 files keep Hugging Face's row order (llama.cpp
runs them with NEOX rope), so they need no flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# GGUF tensor names outside the blocks -> mlx-lm parameter names.
GLOBAL_TENSORS: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# Names inside `blk.N.` -> names inside `model.layers.N.`.
BLOCK_TENSORS: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# config.json key -> GGUF metadata key after `<architecture>.`; all required.
CONFIG_KEYS: dict[str, str] = {
    "hidden_size": "embedding_length",
    "num_hidden_layers": "block_count",
    "intermediate_size": "feed_forward_length",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "max_position_embeddings": "context_length",
}

# Optional keys and the value used when the file does not say.
OPTIONAL_CONFIG_KEYS: dict[str, tuple[str, float | None]] = {
    "rope_theta": ("rope.freq_base", 10000.0),
    "head_dim": ("attention.key_length", None),  # None: hidden_size / heads
}


@dataclass(frozen=True)
class Architecture:
    model_type: str  # mlx-lm's model module
    rope_traditional: bool
    extra_block_tensors: dict[str, str] = field(default_factory=dict)
    # Set in config.json when a q/k/v bias tensor is present (mlx-lm's flag name).
    attention_bias_key: str | None = None


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", rope_traditional=True, attention_bias_key="attention_bias"),
    "qwen2": Architecture("qwen2", rope_traditional=False),
    "qwen3": Architecture(
        "qwen3",
        rope_traditional=False,
        extra_block_tensors={"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    ),
}
