"""`pipeserve node`'s command line: a bad --memory is a usage error (nothing starts)."""

from __future__ import annotations

import pytest

from pipeserve.cli import main


@pytest.mark.parametrize("memory", ["lots", "50%", "-1"])
def test_a_bad_memory_is_a_usage_error(memory: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["node", "--memory", memory, "--no-announce"]) == 2
    assert "pipeserve node: error: --memory" in capsys.readouterr().err


def test_help_names_the_token(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["node", "--help"]) == 0
    assert "PIPESERVE_CLUSTER_TOKEN" in capsys.readouterr().out
