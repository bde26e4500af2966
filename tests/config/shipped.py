"""The repository's own YAML files, and whether the real stage kinds are all present."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def shipped_files() -> list[Path]:
    return sorted(p for folder in ("configs", "pipelines") for p in (REPO / folder).glob("*.y*ml"))


def require_shipped_and_real_stages() -> list[Path]:
    """Skip until the shipped pipelines and every built-in stage module exist."""
    from pipeserve.stages import STAGE_MODULES, load_builtin_stages

    if not list((REPO / "pipelines").glob("*.yaml")):
        pytest.skip("no shipped pipelines yet")
    try:
        load_builtin_stages()
    except ModuleNotFoundError as exc:
        if not str(exc.name).startswith("pipeserve.stages."):
            raise
        pytest.skip(f"stage module missing: {exc.name}")
    assert len(STAGE_MODULES) >= 5
    return shipped_files()
