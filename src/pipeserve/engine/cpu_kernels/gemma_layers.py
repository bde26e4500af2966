"""Gemma 3's decoder layers with each decode step as one op on the CPU.

mlx-lm's gemma3_text block runs about 35 ops per decode step (six `1 + w` norms, three
projections for q / k / v, two for gate / up, two RoPEs, the cache update, attention,
GELU, the residual adds); in Gemma 3 270M's 18 layers that dispatch cost more than the
matmuls. `use_gemma_layers(model, ext)` gives each block whose modules are exactly
mlx-lm's (types checked), whose seven projections are kernel layers and whose norms are
float32 an `ext.DecoderLayer` (fused_layer.cpp) with Gemma's options: norm weights
`1 + w` (computed once here), the norms after attention and after the MLP, GeGLU, q / k
projections of one quantization and v of another side by side (no weights copied: the
op holds the projections' own arrays). Decode steps it takes (engine/cpu_kernels/
cache_steps.py: mlx-lm's KVCache / BatchKVCache of the global layers, and the sliding
layers' RotatingKVCache / BatchRotatingKVCache ring buffers) run as that one op, and
so do prompt chunks of up to `ext.DECODER_LAYER_MAX_PROMPT_TOKENS` tokens per row (the
rings while the prompt fits in the window), the op making the caches' buffers as mlx-lm's
update would (a short prompt's time was the ~35 ops per layer and the first step's
buffer growth, not the matmuls); anything else (longer chunks, a ring past its window
taking several tokens) runs mlx-lm's own forward over the very same modules.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.models import gemma3_text

from pipeserve.engine.cpu_kernels.cache_steps import decode_step
from pipeserve.engine.cpu_kernels.fused_layers import (
    computes_in_float32,
    one_op_step,
    projection_args,
)
from pipeserve.engine.cpu_kernels.layers import KernelLinear, KernelRoPE

_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
          "post_feedforward_layernorm")  # fmt: skip


class GemmaBlock(gemma3_text.TransformerBlock):
    """mlx-lm's Gemma 3 block (same modules, same parameter names) whose decode steps run
    as one op where `decode_step` allows."""

    def __init__(self, block: gemma3_text.TransformerBlock, decoder: Any, max_tokens: int,
                 room: tuple[int, int]) -> None:  # fmt: skip
        nn.Module.__init__(self)
        for name, value in block.items():  # the child modules: parameter names unchanged
            self[name] = value
        for name, value in vars(block).items():  # plain attributes (sizes)
            if not name.startswith("_"):
                setattr(self, name, value)
        self._decoder, self._max_tokens, self._room = decoder, max_tokens, room

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        step = decode_step(x, mask, cache, self._max_tokens, self._room)
        if step is not None:
            return one_op_step(self._decoder, x, cache, step)
        out: mx.array = super().__call__(x, mask, cache)
        return out


def _norm_weight(norm: Any) -> mx.array | None:
    """Gemma's `1 + w` as the op's norm weight, or None: not mlx-lm's float32 norm."""
    if type(norm) is not gemma3_text.RMSNorm or norm.weight.dtype != mx.float32:
        return None
    return mx.contiguous(1.0 + norm.weight)


def gemma_decoder(block: Any, ext: Any) -> Any:
    """`ext.DecoderLayer` over a Gemma 3 block's weights, or None where it does not apply."""
    attention, mlp = block.self_attn, block.mlp
    if type(attention) is not gemma3_text.Attention or type(mlp) is not gemma3_text.MLP:
        return None
    q, k, v, o = attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj
    stages = [[q, k, v], [o], [mlp.gate_proj, mlp.up_proj], [mlp.down_proj]]
    if not all(type(p) is KernelLinear for stage in stages for p in stage):
        return None
    rope = attention.rope
    if type(rope) is not KernelRoPE or rope.base is None:
        return None
    norms = [_norm_weight(block[name]) for name in _NORMS]
    q_norm, k_norm = _norm_weight(attention.q_norm), _norm_weight(attention.k_norm)
    eps = {block[name].eps for name in _NORMS}
    if any(n is None for n in [*norms, q_norm, k_norm]) or len(eps) != 1:
        return None
    try:
        return ext.DecoderLayer(
            [[projection_args(p) for p in stage] for stage in stages],
            norms[0], norms[2], q_norm, k_norm, attention.n_heads, attention.n_kv_heads,
            attention.head_dim, rope.dims, rope.traditional, rope.base, rope.scale,
            attention.scale, eps.pop(), attention.q_norm.eps,
            attn_out_norm=norms[1], mlp_out_norm=norms[3], gelu=True,
        )  # fmt: skip
    except ValueError:  # a shape the op does not take
        return None


def use_gemma_layers(model: nn.Module, ext: Any) -> int:
    """Give every plain Gemma 3 block of `model` its one-op decode step; returns how many
    (none unless the model computes in float32)."""
    if not computes_in_float32(model):
        return 0
    changed = 0
    for name, block in list(model.named_modules()):
        if type(block) is not gemma3_text.TransformerBlock:
            continue
        decoder = gemma_decoder(block, ext)
        if decoder is not None:
            attention = block.self_attn
            room = (attention.n_kv_heads, attention.head_dim)
            twin = GemmaBlock(block, decoder, ext.DECODER_LAYER_MAX_PROMPT_TOKENS, room)
            model.update_modules(tree_unflatten([(name, twin)]))
            changed += 1
    return changed
