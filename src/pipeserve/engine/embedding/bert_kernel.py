"""The BERT encoder as one CPU kernel op over packed sequences (cpu_kernels/bert_encoder.cpp):
the inputs of a batch laid end to end with no padding, every layer on the kernels' threads.

    packed = PackedBert.build(model)    # None: the kernels are unavailable, or the shape does not fit
    vectors = packed.encode(ids, types, lengths)   # (sum(lengths), hidden) float32, numpy

The weights are the MLX model's (bert.py), each linear layer's copied once into the
32-column panels the kernel's GEMM reads (q, k and v side by side), so the MLX model
and this op compute the same network on the same numbers.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import numpy as np

from pipeserve.engine.embedding.bert import BertModel

log = logging.getLogger("pipeserve.engine")

PANEL = 32  # bert_encoder.cpp's panel width: hidden and intermediate sizes must be multiples
CHECK_TOLERANCE = 1e-4  # of the largest magnitude, in the load-time check (measured ~1e-6)


def pack_linear(weight: mx.array) -> mx.array:
    """An nn.Linear weight (N, K) as (N / 32, K, 32): w.T's 32-column panels."""
    n, k = weight.shape
    return mx.contiguous(weight.T.reshape(k, n // PANEL, PANEL).transpose(1, 0, 2))


def fits(model: BertModel) -> bool:
    """The op runs BERT's own layer: learned positions and a GELU feed-forward (nomic-bert's
    rotary positions and SwiGLU stay on the MLX encoder)."""
    config = model.config
    return (
        config.rope_base is None
        and not config.gated
        and config.hidden_size % PANEL == 0
        and config.intermediate_size % PANEL == 0
        and config.hidden_size % config.num_attention_heads == 0
    )


def kernel_weights(model: BertModel) -> list[mx.array]:
    """The op's weight list: the embeddings and their LayerNorm, then 12 per layer."""
    e = model.embeddings
    out = [e.word_embeddings.weight, e.position_embeddings.weight,
           e.token_type_embeddings.weight, e.LayerNorm.weight, e.LayerNorm.bias]  # fmt: skip
    for layer in model.encoder.layer:
        attend = getattr(layer.attention, "self")  # noqa: B009 (the weights' name)
        qkv = mx.concatenate([attend.query.weight, attend.key.weight, attend.value.weight])
        qkv_bias = mx.concatenate([attend.query.bias, attend.key.bias, attend.value.bias])
        a_out, mid, l_out = layer.attention.output, layer.intermediate, layer.output
        out += [pack_linear(qkv), qkv_bias,
                pack_linear(a_out.dense.weight), a_out.dense.bias,
                a_out.LayerNorm.weight, a_out.LayerNorm.bias,
                pack_linear(mid.dense.weight), mid.dense.bias,
                pack_linear(l_out.dense.weight), l_out.dense.bias,
                l_out.LayerNorm.weight, l_out.LayerNorm.bias]  # fmt: skip
    out = [mx.contiguous(w.astype(mx.float32)) for w in out]
    mx.eval(out)
    return out


class PackedBert:
    def __init__(self, ext: Any, model: BertModel) -> None:
        self.ext = ext
        self.config = model.config
        self.weights = kernel_weights(model)

    @classmethod
    def build(cls, model: BertModel) -> PackedBert | None:
        """The op for this model, or None where it cannot run (no kernels: the device is not
        the CPU, PIPESERVE_CPU_KERNELS=off, no compiler; a shape the kernel does not take)."""
        from pipeserve.engine.cpu_kernels import kernels

        if mx.default_device() != mx.cpu or not fits(model):
            return None
        ext = kernels()
        if ext is None or not hasattr(ext, "bert_encode"):
            return None
        packed = cls(ext, model)
        error = packed.check(model)
        if error > CHECK_TOLERANCE:
            log.warning("encoder kernel off: it differs from the MLX encoder by %.3g", error)
            return None
        return packed

    def check(self, model: BertModel) -> float:
        """Two short sequences through this op and through the MLX encoder: the largest
        difference relative to the largest value (on every load, as the kernels' self-test)."""
        lengths = np.array([3, 5])
        ids = np.arange(8, dtype=np.int32) % self.config.vocab_size
        got = self.encode(ids, np.zeros_like(ids), lengths)
        padded = np.zeros((2, 5), np.int32)
        padded[0, :3], padded[1] = ids[:3], ids[3:]
        mask = (np.arange(5)[None] < lengths[:, None]).astype(np.int32)
        want = np.array(model(mx.array(padded), mx.array(mask), mx.zeros((2, 5), mx.int32)))
        want = np.concatenate([want[0, :3], want[1]])
        return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-12))

    def encode(self, ids: np.ndarray, types: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Token vectors (sum(lengths), hidden) of sequences laid end to end in ids / types."""
        config = self.config
        limit = config.max_position_embeddings - config.position_offset
        if len(lengths) == 0 or lengths.min() < 1 or lengths.max() > limit:
            raise ValueError(f"each sequence must hold 1 to {limit} tokens")
        if ids.min() < 0 or ids.max() >= config.vocab_size:
            raise ValueError("token id outside the vocabulary")
        if types.min() < 0 or types.max() >= config.type_vocab_size:
            raise ValueError("token type outside the model's types")
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        out = self.ext.bert_encode(
            mx.array(ids.astype(np.int32)), mx.array(types.astype(np.int32)), mx.array(starts),
            self.weights, config.num_attention_heads, config.layer_norm_eps,
            config.position_offset,
        )  # fmt: skip
        mx.eval(out)
        return np.array(out, copy=False)
