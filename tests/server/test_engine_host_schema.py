"""The engine host wire's schema (server/remote/wire.py), without a server: everything that
crosses it today (jobs with every field, events of every kind, rejections, statuses with
the fleet's view and the cluster's) survives field for field; a pickle frame, random and
truncated frames, wrong types and huge lengths are only ever a ProtocolError or a closed
connection, never another exception, code run or a hang; the handshake refuses a peer
without the secret on either side and its deadline holds."""

from __future__ import annotations

import json
import os
import pickle
import socket
import struct
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeserve.engine.base import GenerationJob
from pipeserve.engine.sharding.control import ChannelClosed, Connection
from pipeserve.events import (
    ContentDelta,
    ErrorEvent,
    Finish,
    KeepAlive,
    PromptReady,
    ReasoningDelta,
    TokenText,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    TopLogprob,
    Usage,
)
from pipeserve.request import SamplingParams
from pipeserve.server.fleet import FleetView
from pipeserve.server.remote import wire
from pipeserve.server.remote.client import HostClient
from pipeserve.server.remote.wire import (
    decode_batch,
    decode_request,
    encode_batch,
    encode_request,
    host_handshake,
    read_sealed,
    worker_handshake,
    write_sealed,
)
from pipeserve.wire_schema import ProtocolError
from tests.jobs import full_job

SECRET = "ab" * 32
LENGTH = struct.Struct("!I")


EVENTS = [
    PromptReady(12, 4),
    TokenText("hé", 7, -0.25, (TopLogprob("a", -0.5, 3), TopLogprob("", float("-inf"), 9))),
    TokenText("", 8),
    ContentDelta("x"),
    ReasoningDelta("why"),
    ToolCallStart(0, "call_1", "get"),
    ToolCallArgsDelta(0, '{"a"'),
    ToolCallEnd(0, '{"a": 1}'),
    ErrorEvent("internal", "engine fault"),
    KeepAlive(),
    Finish("stop", "STOP"),
    Usage(12, 3, 4, 1, 5, 2, 1, 0),
]
STATUS = {
    "models": {
        "k" * 24: {
            "healthy": False,
            "reason": "loading",
            "stats": {"queue_depth": 2, "tps": 1.5},
            "describe": {
                "state": "loading",
                "load": "startup",
                "memory_bytes": 0,
                "loading_seconds": 1.5,
            },
        },  # fmt: skip
    },
    "fleet": FleetView(
        [("demo", True, 1 << 33)], 1, 2, 1 << 33, None, {"demo": 2}, {("demo", "keep_alive"): 1}
    ),  # fmt: skip
    "cluster": {"nodes": [{"address": "10.0.0.2:8471"}], "models": {}, "token_set": True},
}


def test_every_request_round_trips_field_for_field() -> None:
    for message in [("submit", 3, "k" * 24, full_job(), ("root ::= 'a'", "x", True)),
                    ("submit", 4, "k" * 24, GenerationJob("r", [1], SamplingParams(), 1), None),
                    ("cancel", 3), ("status", 9)]:  # fmt: skip
        assert decode_request(encode_request(message)) == message


def test_every_event_reply_and_status_round_trips() -> None:
    rejection = ("overloaded", "queue full", "model", 2.5, "rate_limit_exceeded")
    replies = [(1, None), (2, rejection), (3, STATUS), (4, ("internal", "x", None, None, None))]
    kind, got_replies, got_events = decode_batch(
        encode_batch(replies, [(1, EVENTS), (2, [Usage(1, 0)])])
    )
    assert kind == "batch"
    assert got_replies == replies
    assert got_events == [(1, EVENTS), (2, [Usage(1, 0)])]


def test_large_values_a_request_may_carry_round_trip() -> None:
    sampling = SamplingParams(temperature=float("inf"), logit_bias={-1: -1e300}, seed=2**63)
    job = GenerationJob("r" * 5000, list(range(100_000)), sampling, 2**40,
                        stop_strings=("x" * 200_000,), mock_completion="y" * 1_000_000)  # fmt: skip
    message = ("submit", 1, "k" * 24, job, ("g" * 100_000, "", False))
    assert decode_request(encode_request(message)) == message


def test_a_pickle_payload_is_not_json_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    payload = pickle.dumps(("batch", [(1, Exploit())], []))
    for decode in (decode_request, decode_batch):
        with pytest.raises(ProtocolError, match="not JSON"):
            decode(payload)
    assert not marker.exists()


@pytest.mark.parametrize(
    "body",
    [
        {"v": 1, "kind": "submit", "key": "1", "model": "m", "job": {}, "spec": None},
        {"v": 1, "kind": "submit", "key": 1, "model": "m", "job": [], "spec": None},
        {"v": 1, "kind": "cancel", "key": True},
        {"v": 1, "kind": "status", "key": -1},
        {"v": 2, "kind": "status", "key": 1},
        {"v": 1, "kind": "exec", "key": 1},
        {
            "v": 1,
            "kind": "batch",
            "replies": [{"key": 1, "rejected": {"kind": "pwn"}}],
            "events": [],
        },
        {"v": 1, "kind": "batch", "replies": [{"key": 1, "accepted": 1}], "events": []},
        {"v": 1, "kind": "batch", "replies": [], "events": [[1, [["t", "x", "7", None, []]]]]},
        {"v": 1, "kind": "batch", "replies": [], "events": [[1, [["f", "exploded", None]]]]},
        {"v": 1, "kind": "batch", "replies": [], "events": [[1, [["u", 1, 2]]]]},
        {"v": 1, "kind": "batch", "replies": [], "events": [[1, []]]},
        {
            "v": 1,
            "kind": "batch",
            "replies": [{"key": 1, "status": {"models": {}, "fleet": {}}}],
            "events": [],
        },
    ],
)
def test_wrong_types_are_protocol_errors(body: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError):
        (decode_batch if body["kind"] == "batch" else decode_request)(json.dumps(body).encode())


def decodes_or_refuses(data: bytes) -> None:
    for decode in (decode_request, decode_batch):
        try:
            decode(data)
        except ProtocolError:
            pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_random_bytes_are_only_ever_protocol_errors(data: bytes) -> None:
    decodes_or_refuses(data)


VALID = [encode_request(("submit", 3, "k" * 24, full_job(), ("g", "", True))),
         encode_batch([(1, None), (3, STATUS)], [(1, EVENTS)])]  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(VALID), st.integers(0, 4000), st.binary(max_size=8))
def test_truncated_and_altered_valid_frames_are_only_ever_protocol_errors(
    frame: bytes, cut: int, junk: bytes
) -> None:
    decodes_or_refuses(frame[:cut])
    decodes_or_refuses(frame[:cut] + junk + frame[cut + len(junk) :])


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=24,
)
KEYS = st.sampled_from(["kind", "key", "model", "job", "spec", "replies", "events", "accepted",
                        "rejected", "status", "models", "fleet", "describe", "stats"])  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(KEYS, JSON, max_size=6), st.sampled_from(["submit", "batch", "status", "x"]))
def test_random_json_objects_decode_or_are_protocol_errors(body: dict[str, Any], kind: str) -> None:
    decodes_or_refuses(json.dumps({"v": 1, "kind": kind, **body}).encode())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(JSON, max_size=6), st.sampled_from(["t", "p", "f", "u", "e", "ts", "k", "?"]))
def test_random_events_decode_or_are_protocol_errors(fields: list[Any], tag: str) -> None:
    body = {"v": 1, "kind": "batch", "replies": [], "events": [[1, [[tag, *fields]]]]}
    decodes_or_refuses(json.dumps(body).encode())


# ---------------------------------------------------------------- the connection


def connected() -> tuple[Connection, Connection]:
    """A worker's and the host's ends after a real handshake over a socketpair."""
    a, b = socket.socketpair()
    worker_end, host_end = Connection(a), Connection(b)
    shaking = threading.Thread(target=host_handshake, args=(host_end, SECRET))
    shaking.start()
    worker_handshake(worker_end, SECRET, wait=10)
    shaking.join()
    return worker_end, host_end


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, (1 << 32) - 1), st.binary(max_size=64))
def test_any_announced_length_is_read_within_its_cap_or_refused(size: int, body: bytes) -> None:
    """A frame without its MAC (any length announced, truncated or not) closes the
    connection: the host never reads past MAX_FRAME, never waits past the peer's EOF."""
    worker_end, host_end = connected()
    worker_end.sock.sendall(LENGTH.pack(size) + body)
    worker_end.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(ChannelClosed):
        host_end.recv_bytes()
    worker_end.close()
    host_end.close()


def test_frames_flow_with_their_mac_and_a_replay_is_refused() -> None:
    worker_end, host_end = connected()
    worker_end.send_bytes(encode_request(("status", 1)))
    assert decode_request(host_end.recv_bytes()) == ("status", 1)
    captured = worker_end.session.seal(encode_request(("cancel", 2)))  # type: ignore[union-attr]
    for _ in range(2):
        worker_end.sock.sendall(LENGTH.pack(len(captured)) + captured)
    assert decode_request(host_end.recv_bytes()) == ("cancel", 2)
    with pytest.raises(ChannelClosed, match="wrong MAC"):
        host_end.recv_bytes()


def test_a_silent_or_trickling_hello_is_dropped_at_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(wire, "HANDSHAKE_WAIT", 0.5)
    a, b = socket.socketpair()
    a.sendall(LENGTH.pack(200) + b"{")  # then nothing more
    with pytest.raises(TimeoutError):
        host_handshake(Connection(b), SECRET)
    a.close()
    b.close()


def test_a_worker_leaves_a_host_that_cannot_prove_the_secret(tmp_path: Path) -> None:
    """Something listening at the host's socket without the secret (a stale or planted
    socket): the worker's status finds no host, and it never sends a request there."""
    path = tmp_path / "engines.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    received: list[bytes] = []

    def impostor() -> None:
        sock, _ = listener.accept()
        conn = Connection(sock)
        try:
            host_handshake(conn, "00" * 32)  # its proof is made with another secret
        except (ProtocolError, OSError):
            pass
        sock.settimeout(2)
        try:
            received.append(sock.recv(1 << 16))
        except OSError:
            pass
        sock.close()

    thread = threading.Thread(target=impostor)
    thread.start()
    client = HostClient(path, SECRET, status_wait=5)
    assert client.status() is None
    assert "handshake failed" in client.down_reason
    thread.join()
    listener.close()
    assert received in ([b""], [])  # the worker closed: no proof, no request


def test_a_snapshot_without_the_servers_mac_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "config.pickle"
    write_sealed(path, {"models": [1, 2]}, SECRET)
    assert read_sealed(path, SECRET) == {"models": [1, 2]}
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    path.write_bytes(b"\0" * 32 + pickle.dumps(Exploit()))
    with pytest.raises(ProtocolError, match="MAC"):
        read_sealed(path, SECRET)
    assert not marker.exists()
