"""Fixtures of the tests that run inside the private namespace (harness.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.multimachine.harness import Cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Three machines m1..m3 (10.77.0.1-3), each with a real sshd."""
    with Cluster(3, tmp_path_factory.mktemp("cluster")) as machines:
        yield machines
