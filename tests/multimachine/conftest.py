"""The inner tests run only inside the private namespace the outer tests make."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multimachine.harness import in_private_netns


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if "inner" in collection_path.parts and not in_private_netns():
        return True
    return None
