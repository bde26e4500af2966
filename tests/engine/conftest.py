"""Engine fixtures: one running engine per demo family for the whole session."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from pipeserve.engine.base import ModelRuntime
from pipeserve.engine.runtime import build_runtime
from tests.engine.helpers import entry


@pytest.fixture(scope="session")
def mlx_runtime(demo_model_dir: Callable[[str], object]) -> Iterator[Callable[[str], ModelRuntime]]:
    """family -> a running MlxEngine runtime on its demo model (shared; closed at the end)."""
    built: dict[str, ModelRuntime] = {}

    def get(family: str) -> ModelRuntime:
        if family not in built:
            demo_model_dir(family)
            built[family] = build_runtime(entry(f"demo:{family}"))
        return built[family]

    yield get
    for runtime in built.values():
        runtime.engine.close()


@pytest.fixture(scope="session")
def replay_runtime(
    demo_model_dir: Callable[[str], object],
) -> Iterator[Callable[[str], ModelRuntime]]:
    built: dict[str, ModelRuntime] = {}

    def get(family: str) -> ModelRuntime:
        if family not in built:
            demo_model_dir(family)
            built[family] = build_runtime(entry(f"demo:{family}", engine="replay"))
        return built[family]

    yield get
    for runtime in built.values():
        runtime.engine.close()
