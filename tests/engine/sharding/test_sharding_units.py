"""Sharding pieces that run in one process: layer ranges, seeds rank 0 resolves, and the
CPU layout of tensor-sharded linears (on a 1-rank group, where sharding is the identity,
so the logits must equal the plain model's bit for bit)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.nn.layers.distributed import AllToShardedLinear, ShardedToAllLinear
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from pipeserve.engine.base import GenerationJob
from pipeserve.engine.cpu_kernels import transposed
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
    assert transposed.pretranspose_dense_weights(sharded) > 0
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
    from pipeserve.engine.sharding.placement import Fit
    from pipeserve.engine.weights.demo.families import FAMILIES

    options = ShardingOptions(strategy=strategy, split=split)  # type: ignore[arg-type]
    fit = Fit(options, dict(FAMILIES["qwen3"].config), None, 2)
    hosts = [{"ssh": f"m{i + 1}"} for i in range(usable)]
    chosen, got_split, _ = fit.most_ranks(hosts, [None] * usable)
    assert (len(chosen), got_split) == expected


def test_placement_leaves_out_machines_without_room_for_a_rank() -> None:
    """Each rank's share (here 100 bytes over the ranks) must fit the machine's
    MemAvailable; a machine that did not say is not checked."""
    from pipeserve.config.models import ShardingOptions
    from pipeserve.engine.sharding.placement import Fit, _available
    from pipeserve.engine.weights.demo.families import FAMILIES

    fit = Fit(ShardingOptions(strategy="pipeline"), dict(FAMILIES["qwen3"].config),
              lambda count: 100 // count, 3)  # fmt: skip
    hosts = [{"ssh": "m1"}, {"ssh": "m2"}, {"ssh": "m3"}]
    chosen, _, _ = fit.most_ranks(hosts, [1000, 40, 60])  # 2 ranks: 50 bytes each
    assert [h["ssh"] for h in chosen] == ["m1", "m3"]
    chosen, _, _ = fit.most_ranks(hosts, [1000, None, 60])
    assert [h["ssh"] for h in chosen] == ["m1", "m2"]
    for memory in ([1000, 40, 45], [10, 1000, 1000]):  # too small: the others, rank 0's
        chosen, _, why = fit.most_ranks(hosts, memory)
        assert chosen == [] and "not enough memory: 2 ranks need" in why, why
    assert _available("MemTotal: 9 kB\nMemAvailable:    2048 kB\n") == 2 << 20
    assert _available("") is None


def test_a_failed_placement_ends_its_engine_thread_and_logs_no_traceback(
    tmp_path: Path, demo_model_dir: Any, demo_tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A placement that cannot happen (host 1 does not answer over ssh: nothing listens
    for it on loopback, or it refuses a batch-mode login) raises with the reason; the
    engine thread it started ends instead of parking, and nothing logs a traceback."""
    import shutil
    import threading

    from pipeserve.config.models import EngineOptions, ShardingOptions
    from pipeserve.engine.sharding.engine import ShardedEngine
    from pipeserve.errors import refused_load

    if shutil.which("ssh") is None:
        pytest.skip("no ssh client installed")
    hosts = tmp_path / "hosts.json"
    loopback = [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2
    hosts.write_text(json.dumps({"hosts": loopback}))
    sharding = ShardingOptions(strategy="pipeline", hostfile=str(hosts))
    options = EngineOptions(sharding=sharding)
    name = "unplaceable"
    with pytest.raises(RuntimeError) as caught:
        ShardedEngine(name, demo_model_dir("qwen3"), demo_tokenizer("qwen3"), options)
    assert refused_load(caught.value) is not None
    assert "cannot place the model on 1 of 2 machines" in str(caught.value)
    engine_threads = [t for t in threading.enumerate() if t.name == f"pipeserve-engine-{name}"]
    for thread in engine_threads:
        thread.join(timeout=30)
    assert not [t for t in engine_threads if t.is_alive()]
    assert not [r for r in caplog.records if r.exc_info], caplog.text
