"""The sharded model's control channel on a hostile network (issue 34): no pickle on the
wire, a mutual challenge-response on the group's token before any frame, a MAC on every
frame, and rank 0's listener bounded before authentication (hello size, type, deadline,
one connection never holding up another). Real sockets on loopback, rank 0's real
RankGroup listener; the ranks' side is peer.shake_hands, as a rank runs it."""

from __future__ import annotations

import json
import os
import pickle
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeserve.config.models import EngineOptions, ShardingOptions
from pipeserve.engine.base import GenerationJob
from pipeserve.engine.sharding import peer
from pipeserve.engine.sharding.control import ChannelClosed, Connection
from pipeserve.engine.sharding.frames import (
    VERSION,
    Handshake,
    ProtocolError,
    decode_message,
    encode_message,
)
from pipeserve.engine.sharding.group import GroupLost, Peer, RankGroup
from pipeserve.request import SamplingParams
from pipeserve.wire_schema import JOB_FIELDS
from tests.jobs import full_job

TOKEN = "0123456789abcdef0123456789abcdef"
LENGTH = struct.Struct("!I")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def pair() -> tuple[Connection, socket.socket]:
    ours, theirs = socket.socketpair()
    return Connection(ours), theirs


def test_the_full_job_sets_every_field_the_schema_carries() -> None:
    """A field added to GenerationJob must be added to the schema (wire_schema.py): the
    round trips below would otherwise pass without it (a rank or the engine host would
    silently run the job with its default)."""
    default = GenerationJob("r", [1], SamplingParams(), 1)
    differs = {name for name in JOB_FIELDS if getattr(full_job(), name) != getattr(default, name)}
    assert differs == JOB_FIELDS


# ---------------------------------------------------------------- the schema


def test_every_message_round_trips_field_for_field() -> None:
    changes = [("submit", 3, full_job(), ("root ::= 'a'", "x", True), 12),
               ("submit", 4, GenerationJob("r", [1], SamplingParams(), 1), None, None),
               ("cancel", 3), ("prefix", "trim", 5), ("prefix", "clear")]  # fmt: skip
    for message in [("start", 2**32 - 1), ("ping",), ("close",), ("step", 7, changes)]:
        assert decode_message(encode_message(message)) == message


def test_large_and_odd_values_a_request_may_carry_round_trip() -> None:
    """Whatever passes the HTTP API must pass here too, or one request would break the
    group: long stop strings and completions, big numbers, infinities."""
    sampling = SamplingParams(temperature=float("inf"), logit_bias={-1: -1e300}, seed=2**63)
    job = GenerationJob("r" * 5000, list(range(100_000)), sampling, 2**40,
                        stop_strings=("x" * 200_000,), mock_completion="y" * 1_000_000)  # fmt: skip
    message = ("step", 1, [("submit", 1, job, ("g" * 100_000, "", False), 0)])
    assert decode_message(encode_message(message)) == message


def test_a_pickle_payload_is_rejected_and_never_executed(tmp_path: Path) -> None:
    """The frame that ran code on a rank before (pickle.loads of every frame from the
    control address): now it is not JSON, the connection ends, and the code never ran."""
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    payload = pickle.dumps(("step", 1, [Exploit()]))
    conn, attacker = pair()
    attacker.sendall(LENGTH.pack(len(payload)) + payload)
    with pytest.raises(ChannelClosed, match="not JSON"):
        conn.recv_obj()
    assert not marker.exists()


@pytest.mark.parametrize(
    "body",
    [
        {"v": VERSION, "kind": "step", "step": "1", "changes": []},
        {
            "v": VERSION,
            "kind": "step",
            "step": 1,
            "changes": [{"op": "submit", "key": 1, "job": []}],
        },
        {"v": VERSION, "kind": "start", "seed": 1.5},
        {"v": VERSION, "kind": "start", "seed": True},
        {"v": VERSION + 1, "kind": "ping"},
        {"v": VERSION, "kind": "exec"},
        {"v": VERSION, "kind": "step", "step": 1, "changes": [{"op": "prefix", "change": "drop"}]},
    ],
)
def test_wrong_types_are_protocol_errors(body: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError):
        decode_message(json.dumps(body).encode())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_random_bytes_are_only_ever_protocol_errors(data: bytes) -> None:
    try:
        decode_message(data)
    except ProtocolError:
        pass


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
KEYS = st.sampled_from(["v", "kind", "step", "changes", "seed", "op", "key", "job", "spec",
                        "cached", "change", "count"])  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(KEYS, JSON, max_size=6), st.sampled_from(["step", "start", "ping", "x"]))
def test_random_json_objects_decode_or_are_protocol_errors(body: dict[str, Any], kind: str) -> None:
    body = {"v": VERSION, "kind": kind, **body}
    try:
        decode_message(json.dumps(body).encode())
    except ProtocolError:
        pass


# ---------------------------------------------------------------- handshake and MAC


def sessions() -> tuple[Connection, Connection]:
    """Rank 0's and a rank's connection after a real handshake over a socketpair."""
    a, b = socket.socketpair()
    rank0, rank = Connection(a), Connection(b)
    shake0, shake1 = Handshake(TOKEN, 1), Handshake(TOKEN, 1)
    challenge = shake0.challenge(shake1.hello(1)["nonce"])
    shake0.check_rank(shake1.answer_rank0(challenge))
    rank0.session, rank.session = shake0.session(True), shake1.session(False)
    return rank0, rank


def test_frames_are_accepted_in_order_and_a_replay_or_a_change_is_not() -> None:
    rank0, rank = sessions()
    rank0.send_obj(("ping",))
    rank0.send_obj(("start", 5))
    assert rank.recv_obj() == ("ping",) and rank.recv_obj() == ("start", 5)
    # Captured from the wire: the same sealed frame sent again is refused.
    captured = rank0.session.seal(encode_message(("close",)))  # type: ignore[union-attr]
    for _ in range(2):
        rank0.sock.sendall(LENGTH.pack(len(captured)) + captured)
    assert rank.recv_obj() == ("close",)
    with pytest.raises(ChannelClosed, match="wrong MAC"):
        rank.recv_obj()


def test_a_changed_or_reflected_frame_is_refused() -> None:
    rank0, rank = sessions()
    frame = bytearray(rank0.session.seal(encode_message(("start", 5))))  # type: ignore[union-attr]
    frame[frame.index(b"5")] = ord("6")
    rank0.sock.sendall(LENGTH.pack(len(frame)) + bytes(frame))
    with pytest.raises(ChannelClosed, match="wrong MAC"):
        rank.recv_obj()
    # A rank's own frame sent back to it (reflection) does not verify either.
    rank0b, rankb = sessions()
    own = rankb.session.seal(encode_message(("ping",)))  # type: ignore[union-attr]
    rank0b.sock.sendall(LENGTH.pack(len(own)) + own)
    with pytest.raises(ChannelClosed, match="wrong MAC"):
        rankb.recv_obj()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_no_frame_without_its_mac_changes_the_session(junk: bytes) -> None:
    """Random bytes as a frame: refused, and the genuine next frame is still accepted
    (the sequence number did not move)."""
    rank0, rank = sessions()
    rank0.sock.sendall(LENGTH.pack(len(junk)) + junk)
    with pytest.raises(ChannelClosed):
        rank.recv_obj()
    rank0.send_obj(("ping",))
    assert rank.recv_obj() == ("ping",)


def test_a_listener_without_the_token_gets_no_proof_and_nothing_more() -> None:
    """The rank checks rank 0's proof first: a stranger posing as rank 0 learns nothing
    it can use (the rank's proof is never sent to it)."""
    stranger = Handshake("not-the-token-not-the-token-0000", 1)
    rank = Handshake(TOKEN, 1)
    with pytest.raises(ProtocolError, match="rank 0 did not prove"):
        rank.answer_rank0(stranger.challenge(rank.hello(1)["nonce"]))


# ---------------------------------------------------------------- rank 0's listener


@pytest.fixture
def group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RankGroup]:
    """Rank 0's RankGroup listening on loopback for rank 1 (started by hand)."""
    options = EngineOptions(sharding=ShardingOptions(start_timeout=20.0))
    made = RankGroup("m", tmp_path, options, on_lost=lambda reason: None)
    made._token = TOKEN
    made._listen("127.0.0.1")
    stand_in = subprocess.Popen(["sleep", "60"])  # rank 1's process (a loss kills it)
    made.peers.append(Peer(1, stand_in.pid))
    yield made
    stand_in.kill()
    stand_in.wait()
    made._listener.close()
    for p in made.peers:
        if p.conn is not None:
            p.conn.close()


def address(group: RankGroup) -> tuple[str, int]:
    host, port = group._control.rsplit(":", 1)
    return host, int(port)


def genuine_rank(group: RankGroup, token: str = TOKEN) -> Connection:
    sock = socket.create_connection(address(group), timeout=10)
    conn = Connection(sock)
    monkey = {"PIPESERVE_SHARD_TOKEN": token}
    peer.SETTINGS.update(monkey)
    try:
        peer.shake_hands(conn, 1)
    finally:
        peer.SETTINGS.clear()
    return conn


def accept_in_background(group: RankGroup) -> dict[str, Any]:
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            group._accept_all()
            outcome["joined"] = True
        except GroupLost as exc:
            outcome["lost"] = str(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    outcome["thread"] = thread
    return outcome


def test_hostile_connections_do_not_stop_the_genuine_rank_from_joining(group: RankGroup) -> None:
    """Before: a hello of {"rank": "x"} raised out of _accept_all and aborted the
    placement; a trickling connection held it (one at a time); a hello of 1 GiB was read
    into memory. Now each is refused on its own, and the rank with the token joins."""
    outcome = accept_in_background(group)
    hostile = []
    for hello in ({"rank": "x"}, {"v": VERSION, "rank": [1], "pid": 1, "nonce": "zz"},
                  {"rank": 1, "pid": 2, "token": "guess"}):  # fmt: skip
        s = socket.create_connection(address(group))
        data = json.dumps(hello).encode()
        s.sendall(LENGTH.pack(len(data)) + data)
        hostile.append(s)
    trickle = socket.create_connection(address(group))
    trickle.sendall(b"\x00")  # then nothing: holds its handshake thread, no other
    silent = [socket.create_connection(address(group)) for _ in range(40)]  # a small flood
    before = rss_mib()
    huge = socket.create_connection(address(group))
    huge.sendall(LENGTH.pack(1 << 30))
    try:
        huge.sendall(b"\0" * (64 << 20))  # refused after its 4-byte length
    except OSError:
        pass
    conn = genuine_rank(group)
    outcome["thread"].join(timeout=30)
    assert outcome.get("joined"), outcome
    assert group.peers[0].conn is not None
    assert rss_mib() - before < 32
    # The joined connection carries MACed frames both ways.
    group.peers[0].conn.send_obj(("start", 9))
    assert conn.recv_obj() == ("start", 9)
    conn.send_json({"rank": 1, "weight_bytes": 1})
    assert group.peers[0].conn.recv_json(timeout=5) == {"rank": 1, "weight_bytes": 1}
    for s in [*hostile, trickle, huge, *silent]:
        s.close()


def test_a_rank_without_the_token_is_never_joined(group: RankGroup) -> None:
    """A stranger that says hello as rank 1 gets a challenge, answers it with a guess and
    is closed; the captured proof of a genuine handshake does not fit a new challenge."""
    outcome = accept_in_background(group)
    stranger = Connection(socket.create_connection(address(group)))
    shake = Handshake("f" * 32, 1)
    stranger.send_json(shake.hello(1))
    stranger.recv_json(timeout=5)
    stranger.send_json({"proof": "0" * 64})
    with pytest.raises(ChannelClosed):
        stranger.recv_bytes(timeout=5)
    assert group.peers[0].conn is None
    group.lose("test over")  # a loss ends the wait within a second
    outcome["thread"].join(timeout=5)
    assert "test over" in outcome.get("lost", ""), outcome


def test_a_trickling_hello_is_dropped_at_its_deadline(
    group: RankGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One byte every 0.3 s: the handshake's deadline is for the whole hello, not per read."""
    from pipeserve.engine.sharding import group as group_module

    monkeypatch.setattr(group_module, "HELLO_TIMEOUT", 1.0)
    outcome = accept_in_background(group)
    s = socket.create_connection(address(group))
    started = time.monotonic()
    closed_after = None
    data = LENGTH.pack(200) + b"{" * 200
    for byte in data:
        try:
            s.sendall(bytes([byte]))
            if s.recv(1, socket.MSG_DONTWAIT) == b"":
                closed_after = time.monotonic() - started
                break
        except BlockingIOError:
            pass
        except OSError:
            closed_after = time.monotonic() - started
            break
        time.sleep(0.3)
    assert closed_after is not None and closed_after < 5.0
    genuine_rank(group)
    outcome["thread"].join(timeout=30)
    assert outcome.get("joined"), outcome
