"""Real servers for HTTP tests: one per config, shared by the whole session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.server.serverproc import REPO, running_server
from tests.server.store_servers import Servers, store_servers


@pytest.fixture(scope="session")
def replay_server() -> Iterator[str]:
    with running_server(REPO / "configs" / "replay.yaml") as base:
        yield base


@pytest.fixture(scope="session")
def demo_server() -> Iterator[str]:
    with running_server(REPO / "configs" / "demo.yaml") as base:
        yield base


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """A 2-worker replay server with a response store, started after another server
    stored a response in the same file and stopped (tests/server/store_servers.py)."""
    with store_servers(tmp_path_factory.mktemp("store")) as started:
        yield started
