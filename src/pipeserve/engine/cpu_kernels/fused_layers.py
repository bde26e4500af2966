"""Leaner llama-style layers on the CPU: fewer, larger ops per transformer layer.

mlx-lm's llama / qwen2 / qwen3 layers run about 22 ops each: three projections for
q / k / v, their reshapes and transposes, two RoPEs, the attention, a transpose back,
two for gate / up, SwiGLU, and the residual adds apart from the norms that follow. On
the CPU each op is one dispatch on the stream's thread (and one Python call while the
graph is built), which in a small model's decode step costs as much as the matmuls.

`use_fused_layers(model, ext)` (after `use_fused_ops`) rebuilds each layer whose
modules are exactly mlx-lm's (the attention, MLP and block classes listed below, float32
or kernel projections of one kind, the one-op RoPE and norms) as:

    norm -> qkv (one matmul) -> split_heads (heads, per-head norm, RoPE: one op)
    -> the cache's own update_and_fetch -> attention (heads merged by the op)
    -> o -> add_rms_norm (residual add + next norm: one op) -> gate_up (one matmul)
    -> swiglu (one op) -> down -> add

and, where all four projections are kernel layers, runs each decode step of up to
`ext.DECODER_LAYER_MAX_TOKENS` tokens per row (one token, or a speculative
verification's W; mlx-lm's KVCache or left-padded BatchKVCache with room for them) as
ONE op, `ext.DecoderLayer` (fused_layer.cpp): the same stages in C++, the new keys and
values written into the cache's buffers, which the op takes and returns (MLX's
functional semantics; the buffer is reused where nothing else holds it). A quantized
cache (`options.kv_cache`: mlx-lm's QuantizedKVCache, engine/kv's BatchQuantizedKVCache)
takes the op too (`DecoderLayer.quantized`): the new rows quantized in the op, the
attention reading the codes (attention_quantized.cpp). Prefills, a
full cache buffer, other caches and masks, and float32 projections take the ops above.

The fused projections concatenate the rows of the weights (MLX's affine layout: the
quantized words, scales and biases rows too), so the outputs are the very same numbers.
mlx-lm's cache objects stay (prefix cache, speculative rollback and batching use them);
any other module, architecture or dtype keeps mlx-lm's forward. Sharded models never
get here (their loader does not call it).
"""

from __future__ import annotations

import importlib
from collections import Counter
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from pipeserve.engine.cpu_kernels.cache_steps import CacheStep, advance, decode_step
from pipeserve.engine.cpu_kernels.layers import (
    QUANT_KEYS,
    KernelEmbedding,
    KernelLinear,
    KernelRMSNorm,
    KernelRoPE,
    kernel_attention,
)

_mlx_base: Any = importlib.import_module("mlx_lm.models.base")
# Layer steps the one-op path took, by cache kind ("float", "quantized"): tests and
# benchmarks read it to see which path a decode step took.
ONE_OP_STEPS: Counter[str] = Counter()
FAMILIES = ("llama", "qwen2", "qwen3")  # mlx-lm modules whose layers are reproduced here


def _classes(name: str) -> set[type]:
    found = set()
    for family in FAMILIES:
        module = importlib.import_module(f"mlx_lm.models.{family}")
        found.add(getattr(module, name))
    return found


ATTENTIONS, MLPS, BLOCKS = _classes("Attention"), _classes("MLP"), _classes("TransformerBlock")


def fusable(layers: list[nn.Module]) -> bool:
    """Projections whose rows can be stacked into one: all float32 `nn.Linear` or all
    kernel layers of one bit width, group size and scale type; biases on all or none."""
    first = layers[0]
    if any("bias" in layer for layer in layers) and not all("bias" in layer for layer in layers):
        return False
    if all(type(layer) is nn.Linear for layer in layers):
        return all(layer.weight.dtype == mx.float32 for layer in layers)
    if not all(type(layer) is KernelLinear for layer in layers):
        return False
    return all(
        (layer.bits, layer.group_size, layer.scales.dtype, layer.biases.size == 0)
        == (first.bits, first.group_size, first.scales.dtype, first.biases.size == 0)
        for layer in layers
    )


def side_by_side(layers: list[nn.Module]) -> bool:
    """Kernel projections of several kinds (a Q4_K_M file's q / k Q5_0 and v Q8_0):
    not stackable, but `ext.DecoderLayer` takes them as one stage of several parts."""
    return all(type(layer) is KernelLinear for layer in layers)


class SideBySide(nn.Module):
    """Projections of one input whose outputs lie side by side (their own arrays, nothing
    copied): what `stacked` computes where the rows cannot be stacked."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = parts

    def __call__(self, x: mx.array) -> mx.array:
        return mx.concatenate([part(x) for part in self.parts], axis=-1)


def joined(layers: list[nn.Module]) -> nn.Module:
    """`stacked` where the rows stack, else `SideBySide` (call `fusable` or
    `side_by_side` first)."""
    return stacked(layers) if fusable(layers) else SideBySide(layers)


def stage_parts(projection: nn.Module) -> list[nn.Module]:
    """A stage's projections as `ext.DecoderLayer` takes them."""
    return list(projection.parts) if type(projection) is SideBySide else [projection]


def stacked(layers: list[nn.Module]) -> nn.Module:
    """One projection computing `layers`' outputs side by side (call `fusable` first)."""
    bias = mx.concatenate([layer.bias for layer in layers]) if "bias" in layers[0] else None
    weight = mx.concatenate([layer.weight for layer in layers])
    if type(layers[0]) is nn.Linear:
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        linear.weight = weight
        if bias is not None:
            linear.bias = bias
        return linear
    first: Any = layers[0]
    scales = mx.concatenate([layer.scales for layer in layers])
    biases = mx.concatenate([layer.biases for layer in layers])  # symmetric: all empty
    return KernelLinear.of_arrays(weight, scales, biases, bias, first.group_size, first.bits,
                                  first._ext)  # fmt: skip


def _float32_norm(norm: Any) -> bool:
    return type(norm) is KernelRMSNorm and norm.weight.dtype == mx.float32


class FusedAttention(nn.Module):
    def __init__(self, attention: Any, ext: Any) -> None:
        super().__init__()
        self.qkv_proj = joined([attention.q_proj, attention.k_proj, attention.v_proj])
        self.o_proj = attention.o_proj
        self.n_heads, self.n_kv_heads = attention.n_heads, attention.n_kv_heads
        self.scale, self.rope = attention.scale, attention.rope
        if "q_norm" in attention:
            self.q_norm, self.k_norm = attention.q_norm, attention.k_norm
        self._ext = ext

    @staticmethod
    def applies(attention: Any) -> bool:
        norms = [attention[n] for n in ("q_norm", "k_norm") if n in attention]
        projections = [attention.q_proj, attention.k_proj, attention.v_proj]
        return (
            type(attention) in ATTENTIONS
            and type(attention.rope) is KernelRoPE
            and attention.rope.base is not None
            and all(_float32_norm(norm) for norm in norms)
            and (fusable(projections) or side_by_side(projections))
        )

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        B, L, _ = x.shape
        offset = 0 if cache is None else cache.offset
        positions = offset if isinstance(offset, mx.array) else mx.array([offset], mx.int32)
        rope = self.rope
        q_norm, k_norm = (self.q_norm, self.k_norm) if "q_norm" in self else (None, None)
        queries, keys, values = self._ext.split_heads(
            self.qkv_proj(x), self.n_heads, self.n_kv_heads, rope.dims, rope.traditional,
            rope.base, rope.scale, positions, q_norm and q_norm.weight,
            k_norm and k_norm.weight, q_norm.eps if q_norm else 1e-6,
        )  # fmt: skip
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        output = kernel_attention(self._ext, queries, keys, values, cache, self.scale, mask, True)
        if output is None:
            output = _mlx_base.scaled_dot_product_attention(
                queries, keys, values, cache=cache, scale=self.scale, mask=mask
            )
            output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)
        out: mx.array = self.o_proj(output)
        return out


class FusedMLP(nn.Module):
    def __init__(self, mlp: Any, ext: Any) -> None:
        super().__init__()
        self.gate_up_proj = joined([mlp.gate_proj, mlp.up_proj])
        self.down_proj = mlp.down_proj
        self._ext = ext

    @staticmethod
    def applies(mlp: Any) -> bool:
        projections = [mlp.gate_proj, mlp.up_proj]
        return type(mlp) in MLPS and (fusable(projections) or side_by_side(projections))

    def __call__(self, x: mx.array) -> mx.array:
        out: mx.array = self.down_proj(self._ext.swiglu(self.gate_up_proj(x)))
        return out


class FusedBlock(nn.Module):
    """mlx-lm's block with the residual add and the second norm as one op, and each
    decode step (a few tokens per row) as one op where the block allows (`decoder_layer`)."""

    def __init__(self, block: Any, ext: Any, one_op_steps: bool = True) -> None:
        super().__init__()
        self.self_attn, self.mlp = block.self_attn, block.mlp
        self.input_layernorm = block.input_layernorm
        self.post_attention_layernorm = block.post_attention_layernorm
        for name, value in vars(block).items():  # plain attributes (use_sliding, args)
            if not name.startswith("_"):
                setattr(self, name, value)
        self._ext = ext
        self._decoder: Any = decoder_layer(self, ext) if one_op_steps else None
        self._max_tokens: int = ext.DECODER_LAYER_MAX_TOKENS

    @staticmethod
    def applies(block: Any) -> bool:
        return (
            type(block) in BLOCKS
            and _float32_norm(block.input_layernorm)
            and _float32_norm(block.post_attention_layernorm)
        )

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        step = None if self._decoder is None else decode_step(x, mask, cache, self._max_tokens)
        if step is not None:
            return one_op_step(self._decoder, x, cache, step)
        residual = self.self_attn(self.input_layernorm(x), mask, cache)
        norm = self.post_attention_layernorm
        h, normed = self._ext.add_rms_norm(x, residual, norm.weight, norm.eps)
        out: mx.array = h + self.mlp(normed)
        return out


def one_op_step(decoder: Any, x: mx.array, cache: Any, step: CacheStep) -> mx.array:
    """One layer's decode step through its `ext.DecoderLayer`: the cache's buffers
    replaced by the op's outputs (a quantized cache: its triples), its offsets advanced
    as its own update would."""
    ONE_OP_STEPS["quantized" if step.quantized else "float"] += 1
    if step.quantized:
        out, cache.keys, cache.values = decoder.quantized(
            x, tuple(cache.keys), tuple(cache.values), cache.group_size, cache.bits,
            step.index, step.positions, step.mask,
        )  # fmt: skip
    else:
        out, cache.keys, cache.values = decoder(
            x, cache.keys, cache.values, step.index, step.positions, step.mask, step.seen
        )
    advance(cache, x.shape[1])
    result: mx.array = out
    return result


def projection_args(p: Any) -> tuple[Any, ...]:
    """A kernel projection as `ext.DecoderLayer` takes it."""
    return (p.weight, p.scales, p.biases, p.get("bias"), p.group_size, p.bits)


def decoder_layer(block: FusedBlock, ext: Any) -> Any:
    """`ext.DecoderLayer` over the block's weights, or None where it does not apply:
    attention or MLP not fused, a projection that is not a kernel layer, two norm eps."""
    attention, mlp = block.self_attn, block.mlp
    if type(attention) is not FusedAttention or type(mlp) is not FusedMLP:
        return None
    stages = [stage_parts(p) for p in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj,
                                        mlp.down_proj)]  # fmt: skip
    norms = (block.input_layernorm, block.post_attention_layernorm)
    if not all(type(p) is KernelLinear for parts in stages for p in parts):
        return None
    if norms[0].eps != norms[1].eps:
        return None
    q_norm, k_norm = (attention.q_norm, attention.k_norm) if "q_norm" in attention else (None, None)
    rope, heads = attention.rope, attention.n_heads + 2 * attention.n_kv_heads
    qkv_rows = sum(p.weight.shape[0] for p in stages[0])
    try:
        return ext.DecoderLayer(
            [[projection_args(p) for p in parts] for parts in stages],
            norms[0].weight, norms[1].weight, q_norm and q_norm.weight, k_norm and k_norm.weight,
            attention.n_heads, attention.n_kv_heads, qkv_rows // heads,
            rope.dims, rope.traditional, rope.base, rope.scale, attention.scale, norms[0].eps,
            q_norm.eps if q_norm else 1e-6,
        )  # fmt: skip
    except ValueError:  # a shape the op does not take (e.g. a bias of another dtype)
        return None


_FUSED: list[tuple[str, type[FusedAttention] | type[FusedMLP]]] = [
    ("self_attn", FusedAttention),
    ("mlp", FusedMLP),
]


def computes_in_float32(model: nn.Module) -> bool:
    """Every floating weight float32 but the kernel layers' scales and biases (which the
    kernels read as stored): the activations are float32, which the fused ops take."""
    kernel_layers = {
        name for name, m in model.named_modules() if isinstance(m, (KernelLinear, KernelEmbedding))
    }
    for key, value in tree_flatten(model.parameters()):
        owner, _, leaf = key.rpartition(".")
        if owner in kernel_layers and leaf in QUANT_KEYS:
            continue
        if mx.issubdtype(value.dtype, mx.floating) and value.dtype != mx.float32:
            return False
    return True


def use_fused_layers(model: nn.Module, ext: Any, one_op_steps: bool = True) -> int:
    """Rebuild every plain llama-style block of `model` as the fused layers above (those
    parts that qualify); returns how many blocks changed (none unless the model computes
    in float32). Weights are stacked here. `one_op_steps=False`: decode steps keep the
    per-op path too (the layer op's reference in tests)."""
    if not computes_in_float32(model):
        return 0
    blocks = [(name, m) for name, m in model.named_modules() if FusedBlock.applies(m)]
    changed = 0
    for name, block in blocks:
        fused = [(part, cls) for part, cls in _FUSED if cls.applies(block[part])]
        for part, cls in fused:
            block[part] = cls(block[part], ext)
        fused_block = FusedBlock(block, ext, one_op_steps)
        model.update_modules(tree_unflatten([(name, fused_block)]))
        changed += 1
    mx.eval(model.parameters())
    return changed
