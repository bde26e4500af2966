"""/health's question to the engine host never waits on a lock a request holds (issue 34):
while a request waits up to CONNECT_WAIT seconds for a restarting host, a status question
answers "down" at once (it used to queue behind the request's connect lock)."""

from __future__ import annotations

from pathlib import Path

import gevent

from pipeserve.engine.base import GenerationJob
from pipeserve.request import SamplingParams
from pipeserve.server.remote.client import CONNECT_WAIT, HostClient

SECRET = "ab" * 32


def test_status_answers_while_a_request_waits_for_the_host(tmp_path: Path) -> None:
    client = HostClient(tmp_path / "engine-host.sock", SECRET)  # no host listens there (restarting)
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
    client = HostClient(tmp_path / "engine-host.sock", SECRET)
    assert client.status() is None
    assert "not running" in client.down_reason


SILENT_HOST = r"""
from gevent import monkey

monkey.patch_all()
import json, socket, sys, time

import gevent

from pipeserve.engine.sharding.control import Connection
from pipeserve.server.fleet import FleetView
from pipeserve.server.remote import client as client_module
from pipeserve.server.remote.client import HostClient
from pipeserve.server.remote.wire import decode_request, encode_batch, host_handshake

SECRET = "ab" * 32

client_module.STATUS_STALE = 1.2  # each poll also waits STATUS_FRESH_WAIT (0.2 s) for a fresh answer
path = sys.argv[1]
server = socket.socket(socket.AF_UNIX)
server.bind(path)
server.listen(1)
answers = {"left": 1}


def host() -> None:
    sock, _ = server.accept()
    conn = Connection(sock)
    host_handshake(conn, SECRET)
    while True:  # after its first answer, silent with the connection open: a host that hangs
        message = decode_request(conn.recv_bytes())
        if message[0] == "status" and answers["left"]:
            answers["left"] -= 1
            status = {"models": {}, "fleet": FleetView()}
            conn.send_bytes(encode_batch([(message[1], status)], []))


gevent.spawn(host)
client = HostClient(path, SECRET, status_wait=2.0)
polls = []
for _ in range(12):
    started = time.monotonic()
    answer = client.status()
    polls.append([round(time.monotonic() - started, 3), answer is not None])
    gevent.sleep(0.15)
print(json.dumps(polls))
"""


def test_a_host_that_stops_answering_is_waited_for_once_not_at_every_poll(
    tmp_path: Path,
) -> None:
    """The first answer is used for STATUS_STALE seconds while the host is silent (no
    wait); then status_wait is spent once, and later polls answer "down" at once."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", SILENT_HOST, str(tmp_path / "h.sock")],
                         capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    polls = json.loads(out.stdout.strip().splitlines()[-1])
    answered = [ok for _, ok in polls]
    assert answered[:3] == [True, True, True] and answered[-3:] == [False, False, False]
    waits = [took for took, _ in polls if took > 1.0]
    assert len(waits) <= 1, polls  # the silent host's status_wait, spent once


SLOW_HANDSHAKE_HOST = r"""
from gevent import monkey

monkey.patch_all()
import json, socket, sys

import gevent

from pipeserve.engine.sharding.control import Connection
from pipeserve.server.fleet import FleetView
from pipeserve.server.remote.client import HostClient
from pipeserve.server.remote.wire import decode_request, encode_batch, host_handshake

SECRET = "ab" * 32
server = socket.socket(socket.AF_UNIX)
server.bind(sys.argv[1])
server.listen(8)


def serve(sock) -> None:
    gevent.sleep(0.5)  # every handshake: far longer than a poll's wait
    conn = Connection(sock)
    try:
        host_handshake(conn, SECRET)
        while True:
            message = decode_request(conn.recv_bytes())
            status = {"models": {}, "fleet": FleetView()}
            conn.send_bytes(encode_batch([(message[1], status)], []))
    except OSError:
        pass


def host() -> None:
    while True:
        sock, _ = server.accept()
        gevent.spawn(serve, sock)


gevent.spawn(host)
client = HostClient(sys.argv[1], SECRET, status_wait=0.1)  # a shard host's wait
answered = []
for _ in range(40):
    answered.append(client.status() is not None)
    gevent.sleep(0.15)
print(json.dumps(answered))
"""


def test_a_handshake_slower_than_a_polls_wait_still_connects(tmp_path: Path) -> None:
    """A poll waits status_wait (0.1 s for a shard host) for the connection's handshake,
    which goes on in the background: a host whose every handshake takes longer (a loaded
    machine) is still reached, where abandoning each handshake would never connect."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", SLOW_HANDSHAKE_HOST, str(tmp_path / "h.sock")],
                         capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    answered = json.loads(out.stdout.strip().splitlines()[-1])
    assert answered[-10:] == [True] * 10, answered
