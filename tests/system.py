"""Tests that need something from the system (root, Debian packages, a browser).

Elsewhere they skip, saying what is missing. In CI they must run: `.ci/run` installs what
they need and sets PIPESERVE_CI=1, and there a missing piece fails the test instead of
turning an acceptance test into a green skip.
"""

import os
from typing import NoReturn

import pytest

CI_ENV = "PIPESERVE_CI"


def system_missing(reason: str) -> NoReturn:
    """Skip with the reason; fail with it where CI promised the system pieces."""
    if os.environ.get(CI_ENV) == "1":
        pytest.fail(f"{CI_ENV}=1 but this test cannot run: {reason}")
    pytest.skip(reason)
