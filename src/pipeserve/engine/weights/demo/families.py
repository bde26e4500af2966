"""What each offline demo model is made of: architecture config, vocab, special tokens.

Per-family facts are data here; the builder in `build.py` is family-neutral.
Dims are tiny (random weights; the output is gibberish) but the architectures are the
real mlx-lm ones, so loading, caching, batching and sharding code paths are exercised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeserve.engine.weights.demo.vocab import read_ranks, read_specials

QWEN_SPECIALS_TABLE = "qwen3"

GLM_SPECIALS = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
    "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>",
    "<|begin_of_audio|>", "<|end_of_audio|>", "<|begin_of_transcription|>",
    "<|end_of_transcription|>", "<|code_prefix|>", "<|code_middle|>", "<|code_suffix|>",
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
    "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
    "/nothink", "<|begin_of_box|>", "<|end_of_box|>", "<|image|>", "<|video|>",
)  # fmt: skip

KIMI_SPECIALS = (
    "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
    "<|start_header_id|>", "<|end_header_id|>", "[EOT]", "<|im_system|>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|im_middle|>",
    "<think>", "</think>", "<|endoftext|>", "[UNK]", "[PAD]",
)  # fmt: skip


def appended(table: str, names: tuple[str, ...]) -> dict[str, int]:
    """Special tokens numbered right after a quicktok rank table."""
    base = len(read_ranks(table))
    return {name: base + i for i, name in enumerate(names)}


@dataclass(frozen=True)
class DemoFamily:
    name: str
    vocab: str  # key of pipeserve.engine.weights.demo.vocab.VOCABS
    template: str  # file in engine/weights/demo/templates/
    eos: tuple[str, ...]  # first one is the tokenizer's eos_token
    pad: str
    bos: str | None
    config: dict[str, Any]  # mlx-lm architecture config without vocab_size / eos ids
    special_source: tuple[str, tuple[str, ...]] = (
        "",
        (),
    )  # (quicktok .special, ()) or (table, names)
    seed: int = 0
    extra_tokenizer_config: dict[str, Any] = field(default_factory=dict)

    def specials(self) -> dict[str, int]:
        source, names = self.special_source
        return appended(source, names) if names else read_specials(source)


QWEN3 = DemoFamily(
    name="qwen3",
    vocab="qwen3",
    template="qwen3.jinja",
    eos=("<|im_end|>", "<|endoftext|>"),
    pad="<|endoftext|>",
    bos=None,
    special_source=("qwen3", ()),
    config={
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    },
)

GPT_OSS = DemoFamily(
    name="gpt-oss",
    vocab="o200k",
    template="gpt-oss.jinja",
    eos=("<|return|>", "<|call|>", "<|endoftext|>"),
    pad="<|endoftext|>",
    bos="<|startoftext|>",
    special_source=("o200k_harmony", ()),
    seed=1,
    config={
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000,
        "rope_scaling": None,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    },
)

GLM = DemoFamily(
    name="glm",
    vocab="qwen3",
    template="glm.jinja",
    eos=("<|endoftext|>", "<|user|>", "<|observation|>"),
    pad="<|endoftext|>",
    bos=None,
    special_source=("qwen3", GLM_SPECIALS),
    seed=2,
    config={
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "first_k_dense_replace": 1,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "partial_rotary_factor": 0.5,
        "use_qk_norm": True,
        "attention_bias": True,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    },
)

KIMI = DemoFamily(
    name="kimi",
    vocab="cl100k",
    template="kimi.jinja",
    eos=("<|im_end|>", "[EOS]"),
    pad="[PAD]",
    bos="[BOS]",
    special_source=("cl100k", KIMI_SPECIALS),
    seed=3,
    config={
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0,
        "rope_scaling": None,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    },
)

FAMILIES: dict[str, DemoFamily] = {f.name: f for f in (QWEN3, GPT_OSS, GLM, KIMI)}


# --- the tool-call families of pipelines/*.yaml (issue 36) -------------------------
# Each has the real special tokens of its family at their real ids where the vocabulary
# is the real one (Llama 3: llama3; Phi-4-mini: o200k; Qwen3-Coder and the DeepSeek R1
# Qwen distills: qwen3); Mistral's Tekken, Granite's and Gemma's own vocabularies are
# not shipped offline, so those demos put the family's special tokens after cl100k.


@dataclass(frozen=True)
class PlacedSpecials(DemoFamily):
    """A family whose special tokens are a table's, with some ids named anew (Llama 3.1
    names reserved slots) or added at given ids (Phi-4-mini after o200k)."""

    placed: tuple[tuple[str, int], ...] = ()

    def specials(self) -> dict[str, int]:
        taken = {token_id for _, token_id in self.placed}
        base = {name: i for name, i in read_specials(self.special_source[0]).items()}
        kept = {name: i for name, i in base.items() if i not in taken}
        return {**kept, **dict(self.placed)}


def _dense(model_type: str, architecture: str, **extra: Any) -> dict[str, Any]:
    """A tiny dense decoder config (random weights)."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        **extra,
    }


LLAMA3 = PlacedSpecials(
    name="llama3",
    vocab="llama3",
    template="llama3.jinja",
    eos=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
    pad="<|finetune_right_pad_id|>",
    bos="<|begin_of_text|>",
    special_source=("llama3", ()),
    placed=(
        ("<|finetune_right_pad_id|>", 128004),
        ("<|eom_id|>", 128008),
        ("<|python_tag|>", 128010),
    ),
    seed=4,
    config=_dense("llama", "LlamaForCausalLM"),
)

MISTRAL_SPECIALS = (
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]",
    "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]", "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]",
)  # fmt: skip

MISTRAL = DemoFamily(
    name="mistral",
    vocab="cl100k",
    template="mistral.jinja",
    eos=("</s>",),
    pad="<pad>",
    bos="<s>",
    special_source=("cl100k", MISTRAL_SPECIALS),
    seed=5,
    config=_dense("mistral", "MistralForCausalLM", rope_theta=1000000000.0),
)

QWEN3_CODER = DemoFamily(
    name="qwen3-coder",
    vocab="qwen3",
    template="qwen3-coder.jinja",
    eos=("<|im_end|>", "<|endoftext|>"),
    pad="<|endoftext|>",
    bos=None,
    special_source=("qwen3", ()),
    seed=6,
    config={**QWEN3.config},
)

DEEPSEEK_SPECIALS = (
    "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜begin▁of▁sentence｜>",
    "<|EOT|>", "<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
    "<｜tool▁sep｜>", "<｜▁pad▁｜>",
)  # fmt: skip

DEEPSEEK = DemoFamily(
    name="deepseek",
    vocab="qwen3",
    template="deepseek.jinja",
    eos=("<｜end▁of▁sentence｜>",),
    pad="<｜▁pad▁｜>",
    bos="<｜begin▁of▁sentence｜>",
    special_source=("qwen3", DEEPSEEK_SPECIALS),
    seed=7,
    config=_dense("qwen2", "Qwen2ForCausalLM", rope_theta=10000.0),  # an R1 Qwen distill
)

PHI4 = PlacedSpecials(
    name="phi4",
    vocab="o200k",
    template="phi4.jinja",
    eos=("<|end|>", "<|endoftext|>"),
    pad="<|endoftext|>",
    bos=None,
    special_source=("o200k", ()),
    placed=tuple(
        (name, 200019 + i)
        for i, name in enumerate(
            (
                "<|assistant|>",
                "<|end|>",
                "<|user|>",
                "<|system|>",
                "<|tool|>",
                "<|/tool|>",
                "<|tool_call|>",
                "<|/tool_call|>",
                "<|tool_response|>",
                "<|tag|>",
            )
        )
    ),  # fmt: skip
    seed=8,
    config=_dense("phi3", "Phi3ForCausalLM", rope_theta=10000.0),
)

GRANITE_SPECIALS = (
    "<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>", "<|pad|>",
)  # fmt: skip

GRANITE = DemoFamily(
    name="granite",
    vocab="cl100k",
    template="granite.jinja",
    eos=("<|end_of_text|>",),
    pad="<|pad|>",
    bos=None,
    special_source=("cl100k", GRANITE_SPECIALS),
    seed=9,
    config=_dense(
        "granite",
        "GraniteForCausalLM",
        rope_theta=10000000.0,
        logits_scaling=1.0,
        attention_multiplier=0.25,
        embedding_multiplier=1.0,
        residual_multiplier=1.0,
        attention_bias=False,
        mlp_bias=False,
    ),  # fmt: skip
)

GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")

GEMMA = DemoFamily(
    name="gemma",
    vocab="cl100k",
    template="gemma.jinja",
    eos=("<end_of_turn>", "<eos>"),
    pad="<pad>",
    bos="<bos>",
    special_source=("cl100k", GEMMA_SPECIALS),
    seed=10,
    config=_dense(
        "gemma3_text",
        "Gemma3ForCausalLM",
        num_key_value_heads=1,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        query_pre_attn_scalar=16,
        sliding_window=64,
        sliding_window_pattern=2,
        rms_norm_eps=1e-6,
    ),  # fmt: skip
)

TOOL_FAMILIES = (LLAMA3, MISTRAL, QWEN3_CODER, DEEPSEEK, PHI4, GRANITE, GEMMA)
FAMILIES.update({f.name: f for f in TOOL_FAMILIES})
