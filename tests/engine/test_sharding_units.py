"""Sharding pieces that run in one process: layer ranges, seeds rank 0 resolves, and the
CPU layout of tensor-sharded linears (on a 1-rank group, where sharding is the identity,
so the logits must equal the plain model's bit for bit)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.nn.layers.distributed import AllToShardedLinear, ShardedToAllLinear
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from pipeserve.engine import cpu_layout
from pipeserve.engine.base import GenerationJob
from pipeserve.engine.sharding.cpu_twins import (
    TransposedAllToSharded,
    TransposedShardedToAll,
    register,
)
from pipeserve.engine.sharding.lockstep import resolve_seed
from pipeserve.engine.sharding.pipeline import layer_ranges, split_layers
from pipeserve.request import SamplingParams


def test_layer_ranges_follow_mlx_lm_rank_0_runs_the_last_layers() -> None:
    assert layer_ranges(5, 2, None) == [(2, 5), (0, 2)]
    assert layer_ranges(4, 2, [1, 3]) == [(3, 4), (0, 3)]
    assert layer_ranges(6, 3, None) == [(4, 6), (2, 4), (0, 2)]
    with pytest.raises(ValueError, match="does not cover"):
        layer_ranges(4, 2, [1, 1])


@pytest.mark.parametrize(
    ("params", "draws"),
    [
        (SamplingParams(temperature=0), False),  # greedy
        (SamplingParams(temperature=0.7), False),  # one shared sampler (global random state)
        (SamplingParams(temperature=0.7, seed=5), False),  # the client's own seed
        (SamplingParams(temperature=0.7, top_k=5), True),  # its own sampler: rank 0 draws
        (SamplingParams(temperature=0.7, top_k=5, top_p=2.0), False),  # invalid: rejected later
    ],
)
def test_rank_0_resolves_exactly_the_seeds_a_sampler_would_draw(
    params: SamplingParams, draws: bool
) -> None:
    job = GenerationJob("r", [1, 2], params, 4)
    resolve_seed(job, vocab_size=None)
    assert (job.sampling.seed is not None and params.seed is None) == draws
    if draws:
        assert job.sampling.top_k == 5 and job.sampling.temperature == 0.7


def _logits(model: Any, prompt: list[int], steps: int = 4) -> list[mx.array]:
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[:, -1, :]
    out = [logits]
    for _ in range(steps):
        logits = model(mx.argmax(logits, axis=-1, keepdims=True), cache=cache)[:, -1, :]
        out.append(logits)
    mx.eval(out)
    return out


@pytest.mark.mlx
@pytest.mark.parametrize("family", ["qwen3", "gpt-oss"])
def test_cpu_layout_covers_tensor_sharded_linears(family: str, demo_model_dir: Any) -> None:
    group = mx.distributed.init()  # no ranks configured: the 1-rank group
    assert group.size() == 1
    path: Path = demo_model_dir(family)
    plain, _ = load_model(path)
    sharded, _ = load_model(path, lazy=True)
    sharded.shard(group)
    mx.eval(sharded.parameters())
    kinds = {type(m) for _, m in sharded.named_modules()}
    assert AllToShardedLinear in kinds and ShardedToAllLinear in kinds
    register()
    assert cpu_layout.pretranspose_dense_weights(sharded) > 0
    kinds = {type(m) for _, m in sharded.named_modules()}
    if family == "qwen3":  # bias-free attention and MLP: all twins
        assert TransposedAllToSharded in kinds and TransposedShardedToAll in kinds
        assert AllToShardedLinear not in kinds and ShardedToAllLinear not in kinds
    prompt = [1, 5, 9, 13, 17, 21]
    for expected, got in zip(_logits(plain, prompt), _logits(sharded, prompt)):
        assert mx.array_equal(expected, got).item()


@pytest.mark.mlx
def test_pipeline_adapter_keeps_gpt_oss_layer_metadata_local(demo_model_dir: Any) -> None:
    """With one rank the split keeps every layer; gpt_oss's mask indices stay valid."""
    model, _ = load_model(demo_model_dir("gpt-oss"), lazy=True)
    types = list(model.model.layer_types)
    assert split_layers(model, mx.distributed.init(), None, "gpt_oss") == (0, len(types))
    mx.eval(model.parameters())
    assert model.model.layer_types == types
    assert types[model.model.swa_idx] == "sliding_attention"
    assert types[model.model.ga_idx] == "full_attention"
    plain, _ = load_model(demo_model_dir("gpt-oss"))
    for expected, got in zip(_logits(plain, [3, 4, 5]), _logits(model, [3, 4, 5])):
        assert mx.allclose(expected, got).item()


@pytest.mark.parametrize(
    ("strategy", "split", "usable", "expected"),
    [
        ("pipeline", None, 3, (2, None)),  # 2 layers: at most 2 ranks of the 3 machines
        ("tensor", None, 3, (2, None)),  # 2 KV heads divide by 2, not by 3
        ("pipeline", [1, 1], 2, (2, [1, 1])),  # every host used: the split applies
        ("pipeline", None, 1, (0, None)),  # rank 0 alone is no placement
    ],
)
def test_placement_takes_the_most_ranks_the_shapes_allow(
    strategy: str, split: list[int] | None, usable: int, expected: tuple[int, Any]
) -> None:
    from pipeserve.config.models import ShardingOptions
    from pipeserve.engine.demo_families import FAMILIES
    from pipeserve.engine.sharding.placement import _most_ranks

    options = ShardingOptions(strategy=strategy, split=split)  # type: ignore[arg-type]
    count, got_split, _ = _most_ranks(options, dict(FAMILIES["qwen3"].config), usable, 2)
    assert (count, got_split) == expected
