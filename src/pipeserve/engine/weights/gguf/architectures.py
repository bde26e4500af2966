"""What each supported GGUF architecture becomes in mlx-lm: model type, config keys,
tensor names and rope layout. Data only; convert.py and config_from_gguf.py read it.

Rope layouts (`rope`):
- "traditional": llama.cpp's converter permutes the Q/K rows of llama-family models
  for its interleaved rope, so they run in mlx-lm with `rope_traditional: true` on the
  weights as stored (llama, smollm3: mlx-lm's llama attention takes the flag); GLM-4's
  own rope is interleaved (Hugging Face's rows as stored, mlx-lm's glm4 flag).
- "unpermute": the same permuted rows, for an mlx-lm class without the flag (granite):
  the converter undoes llama.cpp's permutation (rows only, so quantized blocks move
  whole and stay exact).
- "neox": the rows as in Hugging Face's checkpoint (qwen*, gemma*, phi3, olmo2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

REQUIRED: Any = object()  # a config key the file must have

# GGUF tensor names outside the blocks -> mlx-lm parameter names.
GLOBAL_TENSORS: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# GGUF tensors read into config.json instead of weights (llama 3's rope factors, Phi-3's
# longrope factors).
CONFIG_TENSORS: frozenset[str] = frozenset(
    {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
)

# GGUF vectors that mlx-lm holds as a one-row Linear (qwen2moe's shared-expert gate).
ROW_VECTORS: tuple[str, ...] = (".ffn_gate_inp_shexp.weight",)

# GGUF tensors that are one mlx-lm parameter, not a module's `.weight` (gpt-oss's sinks).
PARAMETER_TENSORS: tuple[str, ...] = (".attn_sinks.weight",)

# Names inside `blk.N.` -> names inside `model.layers.N.` (llama's layer).
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

# config.json key -> (GGUF metadata key after `<architecture>.`, default or REQUIRED).
CONFIG_KEYS: dict[str, tuple[str, Any]] = {
    "hidden_size": ("embedding_length", REQUIRED),
    "num_hidden_layers": ("block_count", REQUIRED),
    "intermediate_size": ("feed_forward_length", REQUIRED),
    "num_attention_heads": ("attention.head_count", REQUIRED),
    "num_key_value_heads": ("attention.head_count_kv", None),  # None: as many as heads
    "rms_norm_eps": ("attention.layer_norm_rms_epsilon", REQUIRED),
    "max_position_embeddings": ("context_length", REQUIRED),
    "rope_theta": ("rope.freq_base", 10000.0),
    "head_dim": ("attention.key_length", None),  # None: hidden_size / heads
}

_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA_NORMS = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_EXPERTS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
_SHARED_EXPERT = {
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_MOE_CONFIG = {
    "num_experts": ("expert_count", REQUIRED),
    "num_experts_per_tok": ("expert_used_count", REQUIRED),
    "moe_intermediate_size": ("expert_feed_forward_length", REQUIRED),
    "intermediate_size": ("feed_forward_length", 0),
}
_GEMMA_CONFIG = {"sliding_window": ("attention.sliding_window", 4096)}


@dataclass(frozen=True)
class Architecture:
    model_type: str  # mlx-lm's model module
    rope: Literal["traditional", "unpermute", "neox"]
    block_tensors: dict[str, str] = field(default_factory=dict)  # over BLOCK_TENSORS
    # Set in config.json when a q/k/v bias tensor is present (mlx-lm's flag name).
    attention_bias_key: str | None = None
    config: dict[str, tuple[str, Any]] = field(default_factory=dict)  # over CONFIG_KEYS
    constants: dict[str, Any] = field(default_factory=dict)  # written as they are
    # Norm weights stored as 1 + w (llama.cpp's converter adds the 1 of Gemma's norm):
    # mlx-lm's Gemma norms add it themselves, so the converter takes it off again.
    norms_plus_one: bool = False
    # config.json keys set to the head size (Gemma's query_pre_attn_scalar).
    head_dim_keys: tuple[str, ...] = ()
    # The mlx-lm class has sliding-window layers of its own (gemma3): the file's window
    # goes to `sliding_window`; else a window the file sets makes every layer sliding.
    own_window_pattern: bool = False
    # An encoder (BERT): converted to a Hugging Face folder for the embedding engine by
    # encoder.py; the decoder fields above do not apply.
    encoder: bool = False


ARCHITECTURES: dict[str, Architecture] = {
    # Mistral's files are llama files; a sliding window they set is not applied (llama.cpp
    # does not apply it to the llama architecture either, and mlx-lm's llama needs a
    # full-attention layer).
    "llama": Architecture("llama", rope="traditional", attention_bias_key="attention_bias"),
    "qwen2": Architecture("qwen2", rope="neox"),
    "qwen3": Architecture("qwen3", rope="neox", block_tensors=_QK_NORMS),
    "gemma3": Architecture(
        "gemma3_text",
        rope="neox",
        block_tensors={**_GEMMA_NORMS, **_QK_NORMS},
        config=_GEMMA_CONFIG,
        constants={"rope_local_base_freq": 10000.0, "sliding_window_pattern": 6},
        norms_plus_one=True,
        head_dim_keys=("query_pre_attn_scalar",),
        own_window_pattern=True,
    ),
    "gemma2": Architecture(
        "gemma2",
        rope="neox",
        block_tensors=_GEMMA_NORMS,
        config={
            "attn_logit_softcapping": ("attn_logit_softcapping", 50.0),
            "final_logit_softcapping": ("final_logit_softcapping", 30.0),
            **_GEMMA_CONFIG,
        },
        # local and global layers alternate (engine/weights/variants/gemma2.py)
        constants={"sliding_window_pattern": 2},
        norms_plus_one=True,
        head_dim_keys=("query_pre_attn_scalar",),
        own_window_pattern=True,
    ),
    "phi3": Architecture(
        "phi3",
        rope="neox",
        block_tensors={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    ),
    "granite": Architecture(
        "granite",
        rope="unpermute",
        config={
            "logits_scaling": ("logit_scale", 1.0),
            "attention_multiplier": ("attention.scale", REQUIRED),
            "embedding_multiplier": ("embedding_scale", 1.0),
            "residual_multiplier": ("residual_scale", 1.0),
        },
        constants={"attention_bias": False, "mlp_bias": False},
    ),
    "olmo2": Architecture(
        "olmo2",
        rope="neox",
        block_tensors={
            **_QK_NORMS,
            "post_attention_norm": "post_attention_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
    ),
    "glm4": Architecture(
        "glm4",
        rope="traditional",
        attention_bias_key="attention_bias",
        block_tensors={
            "post_attention_norm": "post_self_attn_layernorm",
            "ffn_norm": "post_attention_layernorm",
            "ffn_up": "mlp.gate_up_proj",
            "post_ffw_norm": "post_mlp_layernorm",
        },
        constants={"partial_rotary_factor": 1.0},  # the file's rope dimension sets it
    ),
    "gpt-oss": Architecture(
        "gpt_oss",
        rope="neox",
        block_tensors={
            "attn_sinks": "self_attn.sinks",
            "post_attention_norm": "post_attention_layernorm",
            "ffn_gate_inp": "mlp.router",
            "ffn_gate_exps": "mlp.experts.gate_proj",
            "ffn_up_exps": "mlp.experts.up_proj",
            "ffn_down_exps": "mlp.experts.down_proj",
        },
        config={
            "num_local_experts": ("expert_count", REQUIRED),
            "num_experts_per_tok": ("expert_used_count", REQUIRED),
            "intermediate_size": ("expert_feed_forward_length", REQUIRED),
            "sliding_window": ("attention.sliding_window", 128),
        },
        own_window_pattern=True,  # mlx-lm alternates sliding and full layers
    ),
    "smollm3": Architecture("smollm3", rope="traditional", constants={"no_rope_layer_interval": 4}),
    "qwen2moe": Architecture(
        "qwen2_moe",
        rope="neox",
        block_tensors={**_EXPERTS, **_SHARED_EXPERT},
        config={
            **_MOE_CONFIG,
            "shared_expert_intermediate_size": ("expert_shared_feed_forward_length", REQUIRED),
        },
    ),
    "qwen3moe": Architecture(
        "qwen3_moe",
        rope="neox",
        block_tensors={**_QK_NORMS, **_EXPERTS},
        config=_MOE_CONFIG,
        constants={"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True},
    ),
    # encoders (embedding models), converted by encoder.py
    "bert": Architecture("bert", rope="neox", encoder=True),
    "nomic-bert": Architecture("nomic_bert", rope="neox", encoder=True),
}
