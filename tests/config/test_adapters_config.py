"""`adapters:` of a model entry in `pipeserve validate`: a bad adapter folder (wrong rank,
missing keys, wrong shapes, unknown target modules, not a folder) is a positioned problem
naming the adapter and what is wrong; adapter names must tell models and adapters apart;
the server's own config load leaves the files to the model's load."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipeserve.config import validate_paths
from pipeserve.config.validate import load_server_config
from tests.config.one_model import REPO
from tests.lora import broken_copy

pytestmark = pytest.mark.mlx


def config(path: Path, source: Path, adapters: dict[str, Path], kind: str = "") -> Path:
    lines = "".join(f"      - {{name: {n}, path: {p}}}\n" for n, p in adapters.items())
    path.write_text(
        f"pipelines_dir: {REPO / 'pipelines'}\n"
        "models:\n"
        "  - name: x\n"
        f"    source: {source}\n"
        "    pipeline: qwen3\n"
        f"{kind}"
        "    adapters:\n"
        f"{lines}"
        "endpoints:\n  - {route: /v1/chat/completions, api: openai-chat}\n"
    )
    return path


def problems(path: Path) -> list[str]:
    return [str(p) for p in validate_paths([path]).problems]


@pytest.fixture
def base(demo_model_dir: Callable[[str], Path]) -> Path:
    return demo_model_dir("qwen3")


def test_adapters_trained_by_mlx_lm_validate(tmp_path: Path, base: Path, lora_adapters) -> None:
    assert problems(config(tmp_path / "c.yaml", base, lora_adapters)) == []
    demo = config(tmp_path / "d.yaml", Path("demo:qwen3"), lora_adapters)
    assert problems(demo) == []  # not a folder on disk: the base checks wait for the load


def edit_rank(config: dict[str, Any], weights: dict[str, Any]) -> None:
    config["lora_parameters"]["rank"] = 16


def drop_b(config: dict[str, Any], weights: dict[str, Any]) -> None:
    del weights["model.layers.1.self_attn.k_proj.lora_b"]


def widen(config: dict[str, Any], weights: dict[str, Any]) -> None:
    import mlx.core as mx

    key = "model.layers.1.mlp.up_proj.lora_a"
    weights[key] = mx.zeros((weights[key].shape[0] + 3, weights[key].shape[1]))


def rename(config: dict[str, Any], weights: dict[str, Any]) -> None:
    for leaf in ("lora_a", "lora_b"):
        weights[f"model.layers.1.self_attn.zz_proj.{leaf}"] = weights.pop(
            f"model.layers.1.self_attn.q_proj.{leaf}"
        )


CASES = [
    (
        edit_rank,
        "model.layers.0.mlp.down_proj: wrong rank: lora_a (128, 8), lora_b (8, 64) for rank 16",
    ),
    (drop_b, "missing key model.layers.1.self_attn.k_proj.lora_b"),
    (widen, "model.layers.1.mlp.up_proj: wrong shapes: lora_a (67, 8)"),
    (rename, "unknown target module 'model.layers.1.self_attn.zz_proj'"),
]


@pytest.mark.parametrize(("edit", "message"), CASES, ids=[c[0].__name__ for c in CASES])
def test_bad_adapter_files_are_positioned_problems(
    tmp_path: Path, base: Path, lora_adapters, edit, message: str
) -> None:
    bad = broken_copy(lora_adapters["pirate"], tmp_path / "bad", edit)
    path = config(tmp_path / "c.yaml", base, {"chef": lora_adapters["chef"], "bad": bad})
    (problem,) = problems(path)
    assert problem.startswith(f"{path}:8:"), problem
    assert "models[0].adapters[1].path: adapter 'bad': " in problem and message in problem
    # The server's own load does not check the files: the model's load refuses the
    # adapter and the base serves (tests/engine/mlx/test_lora.py).
    assert load_server_config(path).config.models[0].adapters[1].name == "bad"


def test_missing_folder_and_not_lora(tmp_path: Path, base: Path, lora_adapters) -> None:
    def dora(config: dict[str, Any], weights: dict[str, Any]) -> None:
        config["fine_tune_type"] = "dora"

    other = broken_copy(lora_adapters["chef"], tmp_path / "dora", dora)
    path = config(tmp_path / "c.yaml", base, {"gone": tmp_path / "nope", "d": other})
    found = problems(path)
    assert len(found) == 2
    assert f"adapter 'gone': {tmp_path / 'nope'} is not a folder" in found[0]
    assert "adapter 'd': fine_tune_type 'dora' is not served" in found[1]


def test_adapter_names_must_be_told_apart(tmp_path: Path, base: Path, lora_adapters) -> None:
    path = config(tmp_path / "c.yaml", base, {"x": lora_adapters["chef"]})
    (problem,) = problems(path)
    assert (
        "models[0].adapters[0].name: adapter name 'x' is already a model or adapter name" in problem
    )
    colon = config(tmp_path / "d.yaml", base, {"a:b": lora_adapters["chef"]})
    assert any("adapters[0].name" in p and "pattern" in p for p in problems(colon))


def test_only_generation_models_take_adapters(tmp_path: Path, base: Path, lora_adapters) -> None:
    path = config(
        tmp_path / "c.yaml", base, {"chef": lora_adapters["chef"]}, "    kind: embedding\n"
    )
    assert any("only generation models take LoRA adapters" in p for p in problems(path))


def test_scopes_may_name_adapters(tmp_path: Path, base: Path, lora_adapters) -> None:
    path = config(tmp_path / "c.yaml", base, {"chef": lora_adapters["chef"]})
    text = path.read_text().replace(
        "models:\n",
        "server:\n  api_keys:\n    - {key: k1, models: [chef, 'x:chef', chfe]}\nmodels:\n",
        1,
    )
    path.write_text(text)
    (problem,) = problems(path)
    assert "server.api_keys[0].models[2]: no model named 'chfe'" in problem
