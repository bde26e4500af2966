"""The node API and the model file server against a hostile LAN (issue 34): a byte relay
without the token, a request replayed to another node, oversized and trickled answers
and requests, a connection flood, and random bytes. Real sockets on loopback (extra
loopback addresses 127.0.0.x stand for other machines); no MLX."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeserve.cluster import node as node_module
from pipeserve.cluster.auth import endpoint, sign_request
from pipeserve.cluster.files import FileServer, fetch_model, manifest
from pipeserve.cluster.node import NodeAgent, NodeHandler, NodeServer
from pipeserve.cluster.planning import explain_lines
from pipeserve.cluster.wire import NodeRefused, NodeUnreachable, NodeUntrusted, call, open_download
from pipeserve.config.models import ShardingOptions
from pipeserve.engine.weights.demo.build import ensure_demo_model

TOKEN = "the-real-cluster-secret-123"


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def start_node(tmp_path: Path) -> tuple[NodeServer, NodeAgent, str]:
    agent = NodeAgent(TOKEN, "default", None, tmp_path)
    server = NodeServer(("127.0.0.1", 0), type("Handler", (NodeHandler,), {"agent": agent}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, agent, f"127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[str, NodeAgent]]:
    server, agent, address = start_node(tmp_path / "a")
    yield address, agent
    server.shutdown()
    server.server_close()


class Relay:
    """Forwards bytes unchanged between its clients and `target` (knows no token)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()


def host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


# ---------------------------------------------------------------- identity


def test_a_byte_relay_is_never_trusted_nor_placed(
    node: tuple[str, NodeAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the relay's answers were the real node's, signed, so it was placed and an
    assignment through it got a signed 202. Now the node refuses requests signed for
    another address, and its signature names its own address, not the relay's."""
    address, agent = node
    relay = Relay(host_port(address))
    try:
        with pytest.raises(NodeUntrusted, match="untrusted"):
            call(relay.address, "GET", "/v1/node", TOKEN)
        with pytest.raises(NodeUntrusted):
            call(relay.address, "POST", "/v1/node/ranks", TOKEN, {"model": "x"})
        monkeypatch.setenv("PIPESERVE_CLUSTER_TOKEN", TOKEN)
        sharding = ShardingOptions(strategy="pipeline", nodes=[relay.address])
        text = "\n".join(explain_lines(Path(ensure_demo_model("qwen3")), sharding))
        assert "cannot place it now" in text and f"node {relay.address}: untrusted" in text
        assert call(address, "GET", "/v1/node", TOKEN)["cluster"] == "default"  # direct: fine
        assert agent.jobs == {}
    finally:
        relay.close()


def test_a_relay_gets_no_model_file(tmp_path: Path) -> None:
    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "qwen3"}')
    server = FileServer("127.0.0.1", TOKEN, source, manifest(source))
    relay = Relay(("127.0.0.1", server.port))
    try:
        host, port = host_port(relay.address)
        with pytest.raises(NodeRefused, match="401"):
            open_download(host, port, "/files/config.json", TOKEN)
        open_download("127.0.0.1", server.port, "/files/config.json", TOKEN)[0].close()
    finally:
        relay.close()
        server.close()


def raw(address: str, request: bytes) -> tuple[int, bytes]:
    with socket.create_connection(host_port(address), timeout=30) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_a_request_captured_for_one_node_is_refused_by_another(
    node: tuple[str, NodeAgent], tmp_path: Path
) -> None:
    first, _ = node
    server, _, second = start_node(tmp_path / "b")
    try:
        headers, _ = sign_request(TOKEN, "GET", "/v1/node", target=first)
        lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        request = f"GET /v1/node HTTP/1.0\r\n{lines}\r\n".encode()
        status, body = raw(second, request)  # replayed to the other node first
        assert status == 401 and b"signed for another address" in body
        assert raw(first, request)[0] == 200  # the node it was meant for takes it
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------- bounded answers


def fake_node(answer: Callable[[socket.socket], None]) -> tuple[socket.socket, str]:
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return listener, f"127.0.0.1:{listener.getsockname()[1]}"


def test_an_oversized_answer_is_refused_with_memory_bounded() -> None:
    """Before: the whole answer was read and parsed before its signature was checked
    (600 MB took rank 0 from 20 to 1170 MiB)."""
    block = b"x" * (1 << 20)

    def huge(conn: socket.socket) -> None:
        try:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % (256 << 20))
            for _ in range(256):
                conn.sendall(block)
        except OSError:
            pass
        finally:
            conn.close()

    listener, address = fake_node(huge)
    before = rss_mib()
    try:
        with pytest.raises(NodeUntrusted, match="over 1048576 bytes"):
            call(address, "GET", "/v1/node", TOKEN)
    finally:
        listener.close()
    assert rss_mib() - before < 32


def test_a_trickled_answer_ends_at_the_calls_deadline() -> None:
    """Before: one byte every few seconds kept call(timeout=5) blocked past 25 s (the
    timeout was per read). Now the timeout is the whole call's: a call with a 1.5 s
    deadline ends, unreachable, while the node is still trickling (a byte every 0.2 s
    would never trip a per-read timeout; the whole answer takes hours)."""
    stop = threading.Event()
    sent = {"bytes": 0}
    answer = b"HTTP/1.0 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 100000

    def trickle(conn: socket.socket) -> None:
        conn.recv(65536)
        try:
            for byte in answer:
                if stop.wait(0.2):
                    break
                conn.sendall(bytes([byte]))
                sent["bytes"] += 1
        except OSError:
            pass
        conn.close()

    listener, address = fake_node(trickle)
    outcome: dict[str, Any] = {}

    def ask() -> None:
        try:
            call(address, "GET", "/v1/node", TOKEN, timeout=1.5)
        except NodeUnreachable as exc:
            outcome["error"] = str(exc)
        outcome["trickled"] = sent["bytes"]

    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    asking.join(timeout=120)  # a hang guard only: the call ends long before the trickle
    stop.set()
    listener.close()
    assert not asking.is_alive() and "error" in outcome, outcome
    assert outcome["trickled"] < len(answer)  # it ended while the node was still sending


def test_nodes_are_asked_in_parallel_under_one_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four silent nodes: placement waits for one deadline, not four in a row. Asked in
    a row, a node would get its request only after the one before was given up; asked
    in parallel, all four have their requests before any is given up."""
    from pipeserve.cluster import planning

    monkeypatch.setattr(planning, "ASK_TIMEOUT", 1.0)
    events: list[str] = []
    lock = threading.Lock()

    def silent(conn: socket.socket) -> None:
        conn.settimeout(120)
        try:
            if conn.recv(65536):
                with lock:
                    events.append("asked")
            while conn.recv(65536):  # until the asking side gives up (closes)
                pass
        except OSError:
            pass
        with lock:
            events.append("given up")
        conn.close()

    nodes = [fake_node(silent) for _ in range(4)]
    try:
        found, skipped = planning.ask_nodes([a for _, a in nodes], TOKEN, None)
    finally:
        for listener, _ in nodes:
            listener.close()
    assert found == [] and len(skipped) == 4, skipped
    for _ in range(600):  # the handlers see the last close within moments (hang guard)
        if len(events) == 8:
            break
        time.sleep(0.05)
    assert events == ["asked"] * 4 + ["given up"] * 4, events


# ---------------------------------------------------------------- bounded requests


def test_bodies_are_bounded_before_authentication(node: tuple[str, NodeAgent]) -> None:
    address, _ = node
    status, body = raw(address, b"GET /v1/node HTTP/1.0\r\nContent-Length: 1000\r\n\r\n")
    assert status == 413 and b"carries no body" in body
    big = b"POST /v1/node/ranks HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % (4 << 20)
    assert raw(address, big)[0] == 413


def connect_from(ip: str, address: str) -> socket.socket:
    sock = socket.socket()
    sock.bind((ip, 0))
    sock.connect(host_port(address))
    return sock


def test_a_connection_flood_leaves_signed_requests_working(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: every connection held a thread (40 x 4 MiB: 53 -> 217 MiB), and 129 silent
    ones at a 128 open-file limit stopped the heartbeats. Now one address holds at most
    MAX_PER_ADDRESS, all of them at most MAX_CONNECTIONS (the oldest yields), and each
    ends CONNECTION_DEADLINE seconds after it opened, however slowly it sends."""
    monkeypatch.setattr(node_module, "CONNECTION_DEADLINE", 2.0)
    server, agent, address = start_node(tmp_path)
    threads_before, before = threading.active_count(), rss_mib()
    flood = [connect_from("127.0.0.2", address) for _ in range(40)]  # one address
    flood += [connect_from(f"127.0.1.{i}", address) for i in range(1, 90)]  # many
    for sock in flood[:20]:
        sock.sendall(b"POST /v1/node/ranks HTTP/1.0\r\nContent-Length: 1000000\r\n\r\nxx")
    try:
        for _ in range(3):  # heartbeats and reports keep answering during the flood
            assert call(address, "GET", "/v1/node", TOKEN, timeout=5.0)["cluster"] == "default"
        assert server.limits.count() <= node_module.MAX_CONNECTIONS
        assert threading.active_count() - threads_before <= node_module.MAX_CONNECTIONS + 4
        assert rss_mib() - before < 64
        trickler = connect_from("127.0.0.3", address)
        trickler.settimeout(10)
        closed = False
        # One byte every 0.2 s: never idle, so only the connection's total deadline (2 s)
        # can end it; it must end while we are still sending (a hang guard of 60 s).
        for _ in range(300):
            try:
                trickler.sendall(b"G")
                if trickler.recv(1, socket.MSG_DONTWAIT) == b"":
                    closed = True
                    break
            except BlockingIOError:
                pass
            except OSError:
                closed = True
                break
            time.sleep(0.2)
        assert closed
    finally:
        for sock in flood:
            sock.close()
        server.shutdown()
        server.server_close()
    assert agent.jobs == {}


# ---------------------------------------------------------------- fuzzing


@pytest.fixture(scope="module")
def fuzz_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, NodeAgent]]:
    server, agent, address = start_node(tmp_path_factory.mktemp("fuzz"))
    yield address, agent
    server.shutdown()
    server.server_close()


REQUEST_PARTS = st.lists(
    st.sampled_from([b"GET ", b"POST ", b"DELETE ", b"/v1/node", b"/v1/node/ranks", b"/x",
                     b" HTTP/1.0\r\n", b"Content-Length: ", b"99999999999", b"-1", b"4",
                     b"Authorization: Pipeserve-HMAC ts=1, nonce=", b"0" * 32, b", mac=",
                     b"0" * 64, b"\r\n", b"\r\n\r\n", b"{}", b"\x00\xff"]) | st.binary(max_size=40),
    max_size=14,
)  # fmt: skip


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])  # fmt: skip
@given(parts=REQUEST_PARTS)
def test_random_requests_change_nothing_and_get_no_signed_answer(
    fuzz_node: tuple[str, NodeAgent], parts: list[bytes]
) -> None:
    address, agent = fuzz_node
    with socket.create_connection(host_port(address), timeout=15) as sock:
        try:
            sock.sendall(b"".join(parts))
            sock.shutdown(socket.SHUT_WR)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        except OSError:
            answer = b""
    assert b"x-pipeserve-signature" not in answer.lower()
    assert agent.jobs == {}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])  # fmt: skip
@given(answer=st.binary(max_size=300) | st.builds(
    lambda n, body: b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % n + body,
    st.integers(-5, 1 << 40), st.binary(max_size=64)))  # fmt: skip
def test_the_file_client_survives_any_answer(tmp_path: Path, answer: bytes) -> None:
    """Random and truncated answers, wrong and huge lengths: an OSError, ValueError or
    NodeRefused within the deadline, and no file left behind."""

    def reply(conn: socket.socket) -> None:
        try:
            conn.recv(65536)
            conn.sendall(answer)
        except OSError:
            pass
        conn.close()

    listener, address = fake_node(reply)
    source = tmp_path / "src"
    source.mkdir(exist_ok=True)
    (source / "config.json").write_text("{}")
    target = tmp_path / "node"
    try:
        with pytest.raises((OSError, ValueError, NodeRefused)):
            fetch_model(target, manifest(source), None, host_port(address), TOKEN)
    finally:
        listener.close()
    assert not (target / "config.json").exists()
    assert not list(target.glob(".*.part"))


def test_endpoint_names_addresses_as_signatures_do() -> None:
    assert endpoint(("127.0.0.1", 80)) == "127.0.0.1:80"
    assert endpoint(("::ffff:10.0.0.2", 7337, 0, 0)) == "10.0.0.2:7337"
    assert endpoint(("fe80::1%eth0", 7337, 0, 2)) == "[fe80::1]:7337"


# ---------------------------------------------------------------- messages (item 8)


def test_stopping_a_rank_answers_before_the_grace_period(node: tuple[str, NodeAgent]) -> None:
    """Before: the node answered a DELETE only after the rank's up to 3 s of grace, and
    rank 0 (waiting 2 s) logged "could not stop rank 1: timed out" for a reachable node.
    Now the answer comes while the rank is still in its grace (it ignores SIGTERM; it is
    killed when its grace ends), whatever the machine's load."""
    import subprocess

    from pipeserve.cluster.node import Assignment, RankJob

    address, agent = node
    stubborn = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 30"])
    job = RankJob("job1", Assignment.model_construct(rank=1, model="m"), "127.0.0.1", state="running",
                  process=stubborn)  # fmt: skip
    agent.jobs[job.id] = job
    time.sleep(0.2)  # the shell has set its trap
    try:
        answer = call(address, "DELETE", "/v1/node/ranks/job1", TOKEN, timeout=60.0)
        still_in_grace = stubborn.poll() is None
        assert answer["state"] == "stopped" and still_in_grace
        assert stubborn.wait(timeout=60) != 0  # killed after its grace, on its own thread
    finally:
        stubborn.kill()
        stubborn.wait()


def test_two_addresses_of_one_node_are_one_node(tmp_path: Path) -> None:
    """A node's signed report carries its stable id: listed twice (two of its addresses),
    it is placed once."""
    from pipeserve.cluster.planning import ask_nodes

    agent = NodeAgent(TOKEN, "default", None, tmp_path)
    server = NodeServer(("0.0.0.0", 0), type("Handler", (NodeHandler,), {"agent": agent}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        nodes, skipped = ask_nodes([f"127.0.0.1:{port}", f"127.0.0.2:{port}"], TOKEN, None)
    finally:
        server.shutdown()
        server.server_close()
    assert [a for a, _ in nodes] == [f"127.0.0.1:{port}"]
    assert skipped == [
        f"node 127.0.0.2:{port}: the same node as 127.0.0.1:{port} (one rank per node)"
    ]
    assert NodeAgent(TOKEN, "default", None, tmp_path).node_id == agent.node_id  # kept
