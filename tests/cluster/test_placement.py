"""Placement math and file selection: pure functions, no processes."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeserve.cluster.files import ModelFile, needed
from pipeserve.cluster.placement import Machine, ModelSizes, model_sizes, place, proportional_layers
from pipeserve.engine.weights.demo.build import ensure_demo_model
from pipeserve.engine.weights.demo.families import QWEN3
from pipeserve.errors import PlacementError

GIB = 2**30
# qwen3 with 6 layers, 6 heads and 3 KV heads: divides over 2, 3 and 6 ranks
CONFIG = {**QWEN3.config, "num_hidden_layers": 6, "num_attention_heads": 6,
          "num_key_value_heads": 3, "intermediate_size": 192}  # fmt: skip
SIZES = ModelSizes(layers=(100,) * 6, other=50)


def machine(address: str, usable: int, device: str = "cpu") -> Machine:
    return Machine(address, usable, device, "cpu" if device == "cpu" else "cuda", "0.32.4")


def test_layers_follow_memory_one_to_two_to_one() -> None:
    assert proportional_layers(8, [1, 2, 1]) == [2, 4, 2]
    assert proportional_layers(6, [3 * GIB, 1 * GIB, 2 * GIB]) == [3, 1, 2]


def test_every_machine_gets_a_layer_and_too_few_layers_is_refused() -> None:
    assert proportional_layers(3, [1000, 1, 1]) == [1, 1, 1]
    with pytest.raises(PlacementError, match="2 layers cannot be split over 3"):
        proportional_layers(2, [1, 1, 1])


@given(
    st.integers(min_value=1, max_value=200),
    st.lists(st.integers(min_value=1, max_value=10**12), min_size=1, max_size=8),
)
def test_proportional_layers_cover_the_model(layers: int, weights: list[int]) -> None:
    if layers < len(weights):
        return
    counts = proportional_layers(layers, weights)
    assert sum(counts) == layers and min(counts) >= 1
    exact = [layers * weight / sum(weights) for weight in weights]
    if min(exact) >= 1:  # no minimum to enforce: largest remainder is within one layer
        assert all(abs(c - e) < 1 for c, e in zip(counts, exact, strict=True))


def test_pipeline_plan_gives_rank_zero_the_last_layers_in_proportion() -> None:
    machines = [machine("this machine", GIB), machine("a:7337", 2 * GIB), machine("b:7337", GIB)]
    plan = place("pipeline", machines, SIZES, CONFIG)
    # 1.5 : 3 : 1.5 layers; the tie for the sixth goes to the earlier rank
    assert plan.split == [2, 3, 1]
    assert [s.layers for s in plan.shares] == [(4, 6), (1, 4), (0, 1)]
    assert [s.bytes for s in plan.shares] == [250, 350, 150]
    assert plan.describe()[1].startswith("rank 1 on a:7337: layers [1, 4), 0.0 MiB of 2048.0")


def test_a_share_that_does_not_fit_names_the_machine() -> None:
    machines = [machine("this machine", 10_000), machine("small:7337", 120)]
    with pytest.raises(PlacementError, match=r"small:7337 needs .* but offers"):
        place("pipeline", machines, SIZES, CONFIG)


def test_tensor_needs_alike_machines_and_dividing_shapes() -> None:
    alike = [machine("this machine", GIB), machine("a", GIB), machine("b", GIB)]
    plan = place("tensor", alike, SIZES, CONFIG)
    assert {s.bytes for s in plan.shares} == {50 + 200} and plan.split == []
    with pytest.raises(PlacementError, match="alike machines"):
        place("tensor", [machine("this machine", GIB), machine("g", GIB, "gpu")], SIZES, CONFIG)
    four = alike + [machine("c", GIB)]
    with pytest.raises(PlacementError, match="does not divide by 4 ranks"):
        place("tensor", four, SIZES, CONFIG)


def test_no_node_found_is_refused() -> None:
    with pytest.raises(PlacementError, match="no other machine"):
        place("pipeline", [machine("this machine", GIB)], SIZES, CONFIG)


def test_model_sizes_read_from_safetensors_headers() -> None:
    sizes = model_sizes(ensure_demo_model("qwen3"))
    assert len(sizes.layers) == QWEN3.config["num_hidden_layers"]
    weights = Path(ensure_demo_model("qwen3")) / "model.safetensors"
    assert 0 < sizes.total <= weights.stat().st_size
    assert sizes.other > sum(sizes.layers)  # the vocabulary dominates a tiny model


def test_a_rank_fetches_only_the_files_holding_its_layers() -> None:
    sha = "0" * 64
    files = [
        ModelFile(name="config.json", size=1, sha256=sha),
        ModelFile(name="model-1.safetensors", size=1, sha256=sha, layers=[0, 1], other=True),
        ModelFile(name="model-2.safetensors", size=1, sha256=sha, layers=[2, 3], other=False),
        ModelFile(name="model-3.safetensors", size=1, sha256=sha, layers=[4, 5], other=False),
    ]
    names = [f.name for f in needed(files, (2, 4))]
    assert names == ["config.json", "model-1.safetensors", "model-2.safetensors"]
    assert len(needed(files, None)) == 4  # tensor: a slice of every layer
