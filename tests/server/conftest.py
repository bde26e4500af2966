"""Real servers for HTTP tests: one per config, shared by the whole session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.server.serverproc import REPO, running_server


@pytest.fixture(scope="session")
def replay_server() -> Iterator[str]:
    with running_server(REPO / "configs" / "replay.yaml") as base:
        yield base


@pytest.fixture(scope="session")
def demo_server() -> Iterator[str]:
    with running_server(REPO / "configs" / "default.yaml") as base:
        yield base
