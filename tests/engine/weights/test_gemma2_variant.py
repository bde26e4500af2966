"""pipeserve's Gemma 2 (engine/weights/variants/gemma2.py): mlx-lm's gemma2 modules with
the sliding-window layers mlx-lm leaves out. On a tiny random Gemma 2: with a window
longer than the sequence it is mlx-lm's gemma2 exactly; with a 3-token window, decoding
token by token on its caches (ring buffers that wrap) gives the whole sequence's logits,
and rows batched with left padding (mlx-lm's batch caches, as the engine runs them) give
each row's own. Against llama.cpp: the gemma2-window case of test_llamacpp.py."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import gemma2 as mlx_gemma2
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

from pipeserve.engine.weights.variants import gemma2, model_classes

pytestmark = pytest.mark.mlx

CONFIG = {"model_type": "gemma2", "hidden_size": 64, "num_hidden_layers": 4,
          "intermediate_size": 96, "num_attention_heads": 4, "head_dim": 16,
          "rms_norm_eps": 1e-6, "vocab_size": 80, "num_key_value_heads": 2,
          "query_pre_attn_scalar": 16, "sliding_window_pattern": 2}  # fmt: skip
IDS = [(11 * i + 5) % 80 for i in range(12)]


def build(module: Any, **extra: Any) -> nn.Module:
    """The same random weights in either class: norms away from 1 + 0, logits large
    enough for the final soft-cap to bend them."""
    model = module.Model(module.ModelArgs.from_dict({**CONFIG, **extra}))
    mx.random.seed(3)
    weights = [(k, mx.random.normal(v.shape) * (0.5 if "norm" in k else 1.0))
               for k, v in sorted(tree_flatten(model.parameters()))]  # fmt: skip
    model.load_weights(weights)
    mx.eval(model.parameters())
    return model


def logits(model: nn.Module, ids: list[int], cache: Any = None) -> np.ndarray:
    return np.array(model(mx.array([ids]), cache=cache)[0])


def stepwise(model: nn.Module, ids: list[int], cache: list[Any]) -> np.ndarray:
    rows = [model(mx.array([[token]]), cache=cache)[0, -1] for token in ids]
    return np.array(mx.stack(rows))


def test_model_type_gemma2_loads_the_variant() -> None:
    assert model_classes({"model_type": "gemma2"}) == (gemma2.Model, gemma2.ModelArgs)
    assert model_classes({"model_type": "llama"})[0].__module__ == "mlx_lm.models.llama"


def test_a_window_past_the_sequence_is_mlx_lms_gemma2() -> None:
    ours, theirs = build(gemma2, sliding_window=64), build(mlx_gemma2)
    want = logits(theirs, IDS)
    assert np.abs(want).max() > 10  # the final soft-cap (30) bends these
    assert np.allclose(logits(ours, IDS), want, atol=1e-4)


def test_the_window_matters_and_its_caches_keep_it() -> None:
    """Window 3: the logits part from global attention's; token-by-token decoding on
    make_cache's caches (RotatingKVCache(3) on layers 0 and 2) equals the whole pass."""
    model = build(gemma2, sliding_window=3)
    whole = logits(model, IDS)
    assert not np.allclose(whole, logits(build(mlx_gemma2), IDS), atol=1e-2)
    cache = model.make_cache()
    assert [type(c) for c in cache] == [RotatingKVCache, KVCache] * 2
    assert cache[0].max_size == 3
    assert np.allclose(stepwise(model, IDS, cache), whole, atol=1e-4)
    # a prompt chunk past the window, then steps on the ring it left
    cache = model.make_cache()
    first = logits(model, IDS[:7], cache)
    rest = stepwise(model, IDS[7:], cache)
    assert np.allclose(np.concatenate([first, rest]), whole, atol=1e-4)


def test_batched_rows_with_left_padding_match_each_row_alone() -> None:
    """Two rows (one left-padded by 4) on BatchRotatingKVCache / BatchKVCache: a prompt,
    then 6 steps; each row's logits are its own alone (the mask broadcast over the kv
    heads' groups)."""
    model = build(gemma2, sliding_window=3)
    rows = [IDS[:4], IDS[2:10]]
    padding = [4, 0]
    cache = [BatchKVCache(padding) if type(c) is KVCache else BatchRotatingKVCache(3, padding)
             for c in model.make_cache()]  # fmt: skip
    prompt = mx.array([[0] * 4 + rows[0], rows[1]])
    out = [model(prompt, cache=cache)[:, -1]]
    steps = [IDS[10 - i] for i in range(6)]
    for token in steps:
        out.append(model(mx.array([[token], [token]]), cache=cache)[:, -1])
    batched = np.array(mx.stack(out, axis=1))
    for r, ids in enumerate(rows):
        alone = logits(model, ids + steps)[len(ids) - 1 :]
        assert np.allclose(batched[r], alone, atol=1e-4), r
