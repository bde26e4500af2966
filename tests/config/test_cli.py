"""`pipeserve` CLI: validate exit codes (in process and through the console script), serve refusal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeserve.cli import main
from tests.config.conftest import GOOD_CONFIG, GOOD_PIPELINE, Tree
from tests.config.shipped import REPO, require_shipped_and_real_stages

CONSOLE_SCRIPT = Path(sys.executable).parent / "pipeserve"


def test_validate_ok_with_default_discovery(tree: Tree, capsys: pytest.CaptureFixture[str]) -> None:
    tree.write("pipelines/qwen3.yaml", GOOD_PIPELINE)
    tree.write("configs/default.yaml", GOOD_CONFIG)
    tree.write("configs/other.yml", GOOD_CONFIG)
    assert main(["validate"]) == 0
    assert capsys.readouterr().out == "ok: 3 files\n"


def test_validate_paths_files_and_folders(tree: Tree, capsys: pytest.CaptureFixture[str]) -> None:
    tree.write("repo/pipelines/qwen3.yaml", GOOD_PIPELINE)
    tree.write("repo/configs/default.yaml", GOOD_CONFIG)
    assert main(["validate", "repo"]) == 0
    assert capsys.readouterr().out == "ok: 2 files\n"
    assert main(["validate", "repo/pipelines/qwen3.yaml", "repo/pipelines"]) == 0
    assert capsys.readouterr().out == "ok: 1 file\n"


@pytest.mark.parametrize(
    ("pipeline", "config", "expected"),
    [
        pytest.param(
            "family: qwen3\nstages:\n  - test_generate: {\n",
            GOOD_CONFIG,
            "pipelines/qwen3.yaml:4:1: (yaml): YAML syntax error: expected the node content, but found '<stream end>'",
            id="yaml-syntax",
        ),
        pytest.param(
            GOOD_PIPELINE,
            GOOD_CONFIG + "modles: []\n",
            "configs/default.yaml:9:1: modles: unknown key 'modles'; did you mean 'models'?",
            id="unknown-top-level-key",
        ),
        pytest.param(
            GOOD_PIPELINE.replace("test_stop:", "test_sotp:"),
            GOOD_CONFIG,
            "pipelines/qwen3.yaml:7:5: stages[4].test_sotp: unknown stage kind 'test_sotp'; did you mean 'test_stop'?",
            id="unknown-stage",
        ),
        pytest.param(
            GOOD_PIPELINE.replace('start: "<think>", ', ""),
            GOOD_CONFIG,
            "pipelines/qwen3.yaml:5:20: stages[2].test_thinking.start: Field required",
            id="missing-stage-param",
        ),
        pytest.param(
            GOOD_PIPELINE,
            GOOD_CONFIG.replace("port: 8080", "port: [8080]"),
            "configs/default.yaml:1:33: server.port: Input should be a valid integer, got a list",
            id="wrong-type",
        ),
        pytest.param(
            GOOD_PIPELINE,
            GOOD_CONFIG.replace("pipeline: qwen3", "pipeline: glm"),
            "configs/default.yaml:5:15: models[0].pipeline: no pipeline 'glm' in pipelines (known: qwen3)",
            id="missing-pipeline",
        ),
        pytest.param(
            GOOD_PIPELINE,
            GOOD_CONFIG.replace("/v1/messages", "/v1/chat/completions"),
            "configs/default.yaml:8:13: endpoints[1].route: duplicate route '/v1/chat/completions' "
            "(also endpoints[0].route at line 7)",
            id="duplicate-route",
        ),
        pytest.param(
            GOOD_PIPELINE.replace("  - test_generate: {}\n", ""),
            GOOD_CONFIG,
            "pipelines/qwen3.yaml:2:1: stages: the pipeline needs exactly one generation stage (e.g. '- generate: {}')",
            id="no-generate-stage",
        ),
        pytest.param(
            GOOD_PIPELINE + "family: again\n",
            GOOD_CONFIG,
            "pipelines/qwen3.yaml:8:1: family: duplicate key 'family' (first defined at line 1, column 1)",
            id="duplicate-key",
        ),
    ],
)
def test_validate_exits_1_with_positioned_messages(
    tree: Tree, capsys: pytest.CaptureFixture[str], pipeline: str, config: str, expected: str
) -> None:
    tree.write("pipelines/qwen3.yaml", pipeline)
    tree.write("configs/default.yaml", config)
    assert main(["validate"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert lines[0].startswith(expected), lines
    assert lines[-1] == "1 problem(s) in 1 file(s)"


def test_validate_usage_errors_exit_2(tree: Tree, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate"]) == 2  # nothing here to validate
    assert "nothing to validate" in capsys.readouterr().err
    assert main(["validate", "missing.yaml"]) == 2
    assert (
        capsys.readouterr().err
        == "pipeserve validate: error: no such file or folder: missing.yaml\n"
    )
    assert main(["validate", "--bogus"]) == 2
    assert main([]) == 2
    assert main(["--help"]) == 0


def test_serve_refuses_an_invalid_config(tree: Tree, capsys: pytest.CaptureFixture[str]) -> None:
    tree.write("pipelines/qwen3.yaml", GOOD_PIPELINE)
    config = tree.write(
        "configs/bad.yaml", GOOD_CONFIG.replace("api: openai-chat}", "api: openai}")
    )
    assert main(["serve", "--config", str(config)]) == 1
    assert (
        capsys.readouterr().err
        == (  # files inside the working directory are named relative to it
            "configs/bad.yaml:7:40: endpoints[0].api: unknown api 'openai'; did you mean 'openai-chat'?\n"
            f"pipeserve: refusing to start: {config} is invalid\n"
        )
    )


def test_serve_default_config_comes_from_the_environment(
    tree: Tree, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    tree.write("pipelines/qwen3.yaml", GOOD_PIPELINE)
    tree.write("configs/env.yaml", GOOD_CONFIG.replace("port: 8080", "port: 0"))
    monkeypatch.setenv("PIPESERVE_CONFIG", "configs/env.yaml")
    assert main(["serve"]) == 1
    assert capsys.readouterr().err.startswith(
        "configs/env.yaml:1:33: server.port: Input should be greater than or equal to 1"
    )
    monkeypatch.delenv("PIPESERVE_CONFIG")
    assert main(["serve"]) == 2  # no configs/default.yaml here
    assert "no such config file: configs/default.yaml" in capsys.readouterr().err


def run_console(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPESERVE_")}
    return subprocess.run(
        [str(CONSOLE_SCRIPT), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_console_script_exit_codes(tmp_path: Path) -> None:
    """The installed `pipeserve` script (no test stage kinds in that process)."""
    (tmp_path / "pipelines").mkdir()
    (tmp_path / "pipelines/bad.yaml").write_text("family: x\nstages:\n  - generate: {\n")
    result = run_console("validate", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.startswith(
        "pipelines/bad.yaml:4:1: (yaml): YAML syntax error: expected the node content, but found '<stream end>'"
    )
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs/x.yaml").write_text("models: []\nendpoints: []\nrouts: 1\n")
    result = run_console("validate", "configs/x.yaml", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "configs/x.yaml:1:9: models: List should have at least 1 item after validation, not 0",
        "configs/x.yaml:2:12: endpoints: List should have at least 1 item after validation, not 0",
        "configs/x.yaml:3:1: routs: unknown key 'routs' (known: endpoints, models, pipelines_dir, server)",
        "3 problem(s) in 1 file(s)",
    ]
    assert run_console("validate", "nope.yaml", cwd=tmp_path).returncode == 2


def test_console_script_accepts_the_shipped_files() -> None:
    files = require_shipped_and_real_stages()
    result = run_console("validate", cwd=REPO)
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == f"ok: {len(files)} files\n"


def test_shipped_files_are_valid_in_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    require_shipped_and_real_stages()
    monkeypatch.chdir(REPO)
    assert main(["validate"]) == 0, capsys.readouterr().err


def test_pre_commit_hook_definition() -> None:
    import re

    import yaml

    (hook,) = yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text())
    assert hook["id"] == "pipeserve-validate"
    assert (hook["entry"], hook["language"], hook["pass_filenames"]) == (
        "pipeserve validate",
        "python",
        True,
    )
    pattern = re.compile(hook["files"])
    for path in ("configs/default.yaml", "pipelines/qwen3.yml", "deploy/pipelines/glm.yaml"):
        assert pattern.search(path), path
    for path in ("src/config.yaml", "configs/sub/x.yaml", ".github/workflows/ci.yaml"):
        assert not pattern.search(path), path


def test_demo_models_unknown_family_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pytest.importorskip("pipeserve.engine.weights.demo.build")
    assert main(["demo-models", "--out", str(tmp_path), "--family", "nope"]) == 2
    assert capsys.readouterr().err.startswith("pipeserve demo-models: error: unknown demo ")


@pytest.mark.mlx
def test_demo_models_builds_and_prints_the_folder(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pytest.importorskip("pipeserve.engine.weights.demo.build")
    assert main(["demo-models", "--out", str(tmp_path), "--family", "qwen3"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    folder = Path(line)
    assert folder.parent == tmp_path / "demo" and folder.name.startswith("qwen3")
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
