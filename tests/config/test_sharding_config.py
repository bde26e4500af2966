"""options.sharding: what validation accepts and the positioned errors for what cannot work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.config.one_model import one_model_config, validate


def write_config(tmp_path: Path, sharding: str, *, extra_model: str = "", server: str = "") -> Path:
    block = f"\n      sharding: {sharding}"
    return one_model_config(
        tmp_path / "sharded.yaml", block, extra_model=extra_model, server=server
    )


@pytest.mark.parametrize(
    "sharding",
    [
        "{ranks: 2}",
        "{strategy: tensor, ranks: 2, backend: ring, step_timeout: 5}",
        "{strategy: pipeline, ranks: 2, split: [1, 1]}",
        "{strategy: pipeline, nodes: auto, cluster: lab-2, memory: 8GiB, discovery_timeout: 1}",
        "{strategy: tensor, nodes: ['10.0.0.2:7337']}",
        "{strategy: pipeline, nodes: [gpu-box]}",
    ],
)
def test_workable_sharding_validates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sharding: str
) -> None:
    code, err = validate(write_config(tmp_path, sharding), capsys)
    assert (code, err) == (0, "")


@pytest.mark.parametrize(
    ("sharding", "position", "message"),
    [
        # 2 layers cannot feed 3 pipeline stages
        ("{strategy: pipeline, ranks: 3}", "7:28: models[0].options.sharding.strategy",
         "2 layers cannot be split over 3 ranks"),
        # 4 heads, 2 KV heads, 128 intermediate: not by 3
        ("{strategy: tensor, ranks: 3}", "7:28: models[0].options.sharding.strategy",
         "num_key_value_heads = 2 does not divide by 3 ranks"),
        ("{strategy: pipeline, ranks: 2, split: [2, 1]}", "7:55: models[0].options.sharding.split",
         "split [2, 1] sums to 3, not to the model's 2 layers"),
        ("{strategy: pipeline, ranks: 2, split: [2]}", "7:17: models[0].options.sharding",
         "split has 1 entries for 2 ranks"),
        ("{strategy: tensor, split: [1, 1]}", "7:17: models[0].options.sharding",
         "split applies to strategy: pipeline only"),
        ("{ranks: 2, backend: mpi}", "7:37: models[0].options.sharding.backend",
         "backend 'mpi' is not available in this MLX build"),
        ("{ranks: 1}", "7:25: models[0].options.sharding.ranks", "greater than or equal to 2"),
        ("{ranks: 2, hostfile: nowhere.json}", "7:38: models[0].options.sharding.hostfile",
         "cannot read the hosts file"),
        ("{nodes: auto, hostfile: hosts.json}", "7:17: models[0].options.sharding",
         "hostfile cannot be combined with nodes"),
        ("{nodes: auto, ranks: 3}", "7:17: models[0].options.sharding",
         "ranks cannot be combined with nodes"),
        ("{nodes: [a, a]}", "7:25: models[0].options.sharding.nodes", "listed twice"),
        ("{nodes: []}", "7:25: models[0].options.sharding.nodes", "at least one node"),
        ("{nodes: auto, memory: 50%}", "7:17: models[0].options.sharding", "not a share"),
        ("{nodes: auto, cluster: 'a b'}", "7:40: models[0].options.sharding.cluster",
         "should match pattern"),
        # two nodes named: 3 ranks, and qwen3's 2 KV heads do not divide by 3
        ("{strategy: tensor, nodes: [a, b]}", "7:28: models[0].options.sharding.strategy",
         "num_key_value_heads = 2 does not divide by 3 ranks"),
    ],
)  # fmt: skip
def test_unworkable_sharding_is_a_positioned_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sharding: str, position: str, message: str
) -> None:
    code, err = validate(write_config(tmp_path, sharding), capsys)
    assert code == 1
    assert any(position in line and message in line for line in err.splitlines()), err


def test_architecture_without_shard_names_the_supported_pipelines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "glm4-dense"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "glm4", "num_hidden_layers": 4}))
    for strategy, expected in [
        ("tensor", "architecture 'glm4' has no shard() in mlx-lm"),
        ("pipeline", "architecture 'glm4' is not supported; supported: mlx-lm's pipeline()"),
    ]:
        config = write_config(tmp_path, f"{{strategy: {strategy}}}")
        config.write_text(config.read_text().replace("demo:qwen3", str(model)))
        code, err = validate(config, capsys)
        assert code == 1 and "models[0].options.sharding.strategy" in err
        assert expected in err and ("qwen3, llama, gpt_oss" in err) == (strategy == "pipeline")


def test_several_sharded_models_and_on_demand_validate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each sharded model runs in a shard host of its own (server/remote/host.py)."""
    second = (
        "  - name: y\n    source: demo:qwen3\n    pipeline: qwen3\n    load: on_demand\n"
        "    options:\n      sharding: {ranks: 2}\n"
    )
    config = write_config(
        tmp_path, "{ranks: 2}", extra_model=second, server="server: {workers: 2}\n"
    )
    assert validate(config, capsys) == (0, "")


def test_replay_engine_cannot_be_sharded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, "{ranks: 2}")
    config.write_text(
        config.read_text().replace("    options:\n", "    engine: replay\n    options:\n")
    )
    code, err = validate(config, capsys)
    assert code == 1 and "sharding needs engine: mlx, not 'replay'" in err


def test_hostfile_sets_the_rank_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hosts = [{"ssh": "m1", "ips": ["10.0.0.1"]}, {"ssh": "m2", "ips": ["10.0.0.2"]},
             {"ssh": "m3", "ips": ["10.0.0.3"]}]  # fmt: skip
    (tmp_path / "hosts.json").write_text(json.dumps({"backend": "ring", "hosts": hosts}))
    # 3 hosts: qwen3's 2 KV heads do not divide by 3, but it is placed on 2 of them
    # (placement.py), so the config is valid; without a hosts file 3 ranks are refused
    code, err = validate(write_config(tmp_path, "{hostfile: hosts.json}"), capsys)
    assert code == 0, err
    code, err = validate(write_config(tmp_path, "{ranks: 3}"), capsys)
    assert code == 1 and "num_key_value_heads = 2 does not divide by 3 ranks" in err
    code, err = validate(write_config(tmp_path, "{hostfile: hosts.json, ranks: 2}"), capsys)
    assert code == 1 and "ranks 2 but the hosts file lists 3 hosts" in err
