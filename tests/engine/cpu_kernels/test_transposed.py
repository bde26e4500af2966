"""Transposed float32 weights on the CPU: same numbers as mlx-lm's own layout."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache

from pipeserve.engine.cpu_kernels.transposed import (
    TRANSPOSE_ROWS,
    TransposedEmbedding,
    TransposedLinear,
    pretranspose_dense_weights,
    transposed,
)
from pipeserve.engine.weights.loader import load_model


def _dense_layers(model: nn.Module) -> list[str]:
    """Names of the bias-free float32 Linear / Embedding layers in nn's (N, K) layout (the
    transform's targets; their f32_matmul twins, cpu_kernels/layers.py, count too)."""
    return [name for name, m in model.named_modules()
            if isinstance(m, (nn.Linear, nn.Embedding)) and "bias" not in m and m.weight.dtype == mx.float32]  # fmt: skip


def _logits_over_steps(model: nn.Module, prompt: list[int], steps: int) -> list[mx.array]:
    """Prefill, then greedy decode steps through the KV cache, keeping every step's logits."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[:, -1, :]
    out = [logits]
    for _ in range(steps):
        token = mx.argmax(logits, axis=-1, keepdims=True)
        logits = model(token, cache=cache)[:, -1, :]
        out.append(logits)
    mx.eval(out)
    return out


@pytest.mark.parametrize("family", ["qwen3", "gpt-oss", "glm", "kimi"])
def test_transposed_model_is_bit_identical(family, demo_model_dir):
    reference = load_model(demo_model_dir(family))
    transposed = load_model(demo_model_dir(family), cpu_pretranspose=True)
    # gpt-oss's only bias-free float32 layers are its embedding and lm_head, which both
    # loads hold as the kernels' panels (cpu_kernels/layers.py), from either layout
    panels = [name for name, m in reference.named_modules() if "weight_panels" in m]
    assert _dense_layers(reference) or panels, "the demo model has dense float32 layers"
    assert _dense_layers(transposed) == []
    prompt = list(range(100, 140))
    for expected, got in zip(
        _logits_over_steps(reference, prompt, 6), _logits_over_steps(transposed, prompt, 6)
    ):
        assert mx.array_equal(expected, got).item()


def test_layers_keep_their_weights():
    mx.random.seed(3)
    linear = nn.Linear(24, 40, bias=False)
    embedding = nn.Embedding(50, 24)
    x = mx.random.normal((5, 24))
    ids = mx.array([[1, 7, 49], [0, 0, 3]])
    t_linear, t_embedding = TransposedLinear(linear), TransposedEmbedding(embedding)
    assert t_linear.weight_t.shape == (24, 40)
    assert mx.array_equal(t_linear.weight, linear.weight).item()
    assert mx.array_equal(t_linear(x), linear(x)).item()
    assert mx.array_equal(t_embedding(ids), embedding(ids)).item()
    assert mx.array_equal(t_embedding.as_linear(x), embedding.as_linear(x)).item()
    assert "weight" not in t_linear.parameters(), "one copy of the matrix, not two"


def test_only_bias_free_float32_layers_are_transposed():
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False), nn.Linear(8, 8))
    model.layers[1].set_dtype(mx.float16)
    assert pretranspose_dense_weights(model) == 1
    assert isinstance(model.layers[0], TransposedLinear)
    assert type(model.layers[1]) is nn.Linear and type(model.layers[2]) is nn.Linear


def test_off_by_option_and_after_a_half_precision_cast(demo_model_dir):
    assert _dense_layers(load_model(demo_model_dir("qwen3"), cpu_pretranspose=False))
    half = load_model(demo_model_dir("qwen3"), "float16", cpu_pretranspose=True)
    assert not any(
        isinstance(m, (TransposedLinear, TransposedEmbedding)) for _, m in half.named_modules()
    )


@pytest.mark.parametrize("rows", [1, TRANSPOSE_ROWS, TRANSPOSE_ROWS + 1, 3 * TRANSPOSE_ROWS - 7])
def test_tiled_transpose_equals_transpose(rows):
    weight = mx.random.normal((rows, 24))
    out = transposed(weight)
    assert out.shape == (24, rows)
    assert mx.array_equal(out, weight.T).item()
