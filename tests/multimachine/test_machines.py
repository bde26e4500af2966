"""Multi-machine tests: each file of inner/ runs in its own private network namespace
(`unshare -n`) holding emulated machines (harness.py). Marked `multimachine`; skipped
with one line where namespaces cannot be made (not root, tools missing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multimachine.harness import missing, run_pytest_in_private_netns
from tests.system import system_missing

pytestmark = [pytest.mark.multimachine]
INNER = Path(__file__).parent / "inner"
FILES = sorted(p.name for p in INNER.glob("test_*.py"))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", FILES)
def test_in_private_network_namespace(name: str) -> None:
    reason = missing()
    if reason:
        system_missing(f"cannot emulate machines: {reason}")
    result = run_pytest_in_private_netns(["-q", "-s", "-rfE", str(INNER / name)], timeout=900)
    print(result.stdout[-20000:], result.stderr[-5000:])
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
