"""Sharding is not implemented yet: a config asking for it is refused, not served unsharded."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeserve.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_sharding_block_is_a_positioned_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "sharded.yaml"
    config.write_text(
        f"pipelines_dir: {REPO / 'pipelines'}\n"
        "models:\n  - name: x\n    source: demo:qwen3\n    pipeline: qwen3\n"
        "    options:\n      sharding: {ranks: 2}\n"
        "endpoints:\n  - {route: /v1/chat/completions, api: openai-chat}\n"
    )
    assert main(["validate", str(config)]) == 1
    err = capsys.readouterr().err
    assert (
        f"{config}:7:17: models[0].options.sharding:" in err
        or "sharded.yaml:7:17: models[0].options.sharding:" in err
    )
    assert "sharding is not implemented" in err
