"""Engine fixtures: one running engine per demo family for the whole session."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pipeserve.engine import cpu_kernels
from pipeserve.engine.base import ModelRuntime
from pipeserve.engine.cpu_kernels.build import missing_tools
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


@pytest.fixture(scope="session")
def ext() -> Any:
    """The built and self-tested CPU kernels extension (skips where it cannot build)."""
    if missing_tools():
        pytest.skip(f"no {' / '.join(missing_tools())} to build the CPU kernels")
    if cpu_kernels.forced_off():
        pytest.skip(f"{cpu_kernels.ENV_SWITCH}=off")
    module = cpu_kernels.kernels()
    assert module is not None, "the CPU kernels failed to build or self-test (see the log)"
    return module
