"""/health's question to the engine host never waits on a lock a request holds (issue 34):
while a request waits up to CONNECT_WAIT seconds for a restarting host, a status question
answers "down" at once (it used to queue behind the request's connect lock)."""

from __future__ import annotations

from pathlib import Path

import gevent

from pipeserve.engine.base import GenerationJob
from pipeserve.request import SamplingParams
from pipeserve.server.remote.client import CONNECT_WAIT, HostClient


def test_status_answers_while_a_request_waits_for_the_host(tmp_path: Path) -> None:
    client = HostClient(tmp_path / "engine-host.sock")  # no host listens there (restarting)
    job = GenerationJob("r1", [1, 2, 3], SamplingParams(), max_tokens=4)
    waiting = gevent.spawn(client.submit, "demo", job)
    gevent.sleep(0.3)  # the request now holds the connect lock, retrying
    assert not waiting.ready()
    for _ in range(3):  # every poll, not only the first
        assert client.status() is None
        gevent.sleep(0.11)  # past the status cache
    assert not waiting.ready(), f"status waited for the request's {CONNECT_WAIT:g} s connect"
    assert "not running" in client.down_reason
    waiting.kill()


def test_status_connects_by_itself_when_no_request_is_connecting(tmp_path: Path) -> None:
    client = HostClient(tmp_path / "engine-host.sock")
    assert client.status() is None
    assert "not running" in client.down_reason
