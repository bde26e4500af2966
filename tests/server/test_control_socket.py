"""gunicorn >= 27 opens a management socket at one fixed path under $HOME, shared by all
of a user's servers; pipeserve turns it off (it is managed by signals)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.server.serverproc import REPO, server_log, server_process

pytestmark = pytest.mark.server


def test_no_gunicorn_control_socket_under_home(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    with server_process(REPO / "configs" / "replay.yaml", env={"HOME": str(home)}) as (base, _):
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        log = server_log(base).read_text()
    assert not (home / ".gunicorn").exists(), sorted(p.name for p in home.rglob("*"))
    assert "Control server" not in log
