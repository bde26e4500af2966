"""Fixtures of the protocol tests; the shared harness functions are in helpers.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


@pytest.fixture
def qwen3_runtime(replay_runtime: Callable[[str], Any]) -> Any:
    """The replay engine on the qwen3 demo model's real tokenizer (exact model output);
    the session's shared runtime (tests/conftest.py `replay_runtime`)."""
    return replay_runtime("qwen3")
