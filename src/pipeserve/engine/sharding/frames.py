"""The control channel's frames in a fixed schema, and who may send them.

Nothing on this channel is ever unpickled: rank 0's messages (the start seed, pings,
close, each step's batch log with its jobs) are JSON objects of one version, decoded by
`decode_message` into exactly the tuples lockstep.py replays, every field type-checked
(ProtocolError otherwise); a rank's reports are JSON objects too.

Before any frame is accepted both ends prove they hold the group's secret token, and
neither sends it (`Handshake`): the rank sends its rank, pid and a fresh nonce; rank 0
answers with its own nonce and an HMAC over both nonces and the rank; the rank checks it
(a listener that does not know the token is left at once) and answers its own HMAC; rank
0 checks that. Both then derive a session key from the token and the two nonces, and
every later frame carries an HMAC-SHA256 over its direction, its sequence number and its
bytes (`Session`): a frame changed, dropped, replayed, reordered or reflected on the path
ends the connection. Every comparison is hmac.compare_digest.

Not encrypted: whoever is on the path reads the prompts' token ids (see docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass
from typing import Any

from pipeserve.wire_schema import (
    TEXT,
    ProtocolError,
    array,
    boolean,
    decode_job,
    decode_object,
    encode_job,
    encode_object,
    int_in,
    obj,
    text,
)

VERSION = 2  # 2: a job carries its thinking budget and prompt group
MAC_SIZE = 32
NONCE_BYTES = 16
HELLO_MAX = 1024  # bytes of a handshake frame: anything longer is refused unread
_SEQ = struct.Struct("!Q")


# ---------------------------------------------------------------- the handshake


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"\0".join(parts), hashlib.sha256).digest()


@dataclass
class Handshake:
    """One side of the mutual challenge-response (module doc)."""

    token: str
    rank: int
    mine: str = ""  # this side's nonce (hex)
    theirs: str = ""
    # What the proofs and the session key are for: another channel that reuses this
    # handshake (the engine host's wire) names itself, so no proof crosses channels.
    context: bytes = b"pipeserve-control"

    def __post_init__(self) -> None:
        self.mine = self.mine or secrets.token_hex(NONCE_BYTES)

    def _proof(self, role: bytes, rank_nonce: str, rank0_nonce: str) -> str:
        key = self.token.encode()
        parts = (self.context, role, rank_nonce.encode(), rank0_nonce.encode())
        return _mac(key, *parts, str(self.rank).encode()).hex()

    # The rank: hello(), then check rank 0's answer and send answer_rank0's proof.
    def hello(self, pid: int) -> dict[str, Any]:
        return {"v": VERSION, "rank": self.rank, "pid": pid, "nonce": self.mine}

    def answer_rank0(self, challenge: dict[str, Any]) -> dict[str, Any]:
        """The rank checks rank 0's proof (ProtocolError if wrong) and proves itself."""
        self.theirs = _nonce(challenge.get("nonce"))
        expected = self._proof(b"rank0", self.mine, self.theirs)
        if not hmac.compare_digest(expected, text(challenge.get("proof"), 2 * MAC_SIZE)):
            raise ProtocolError("rank 0 did not prove it holds the group's token")
        return {"proof": self._proof(b"rank", self.mine, self.theirs)}

    # Rank 0: challenge(hello), then check the rank's proof.
    def challenge(self, rank_nonce: str) -> dict[str, Any]:
        self.theirs = rank_nonce
        return {"v": VERSION, "nonce": self.mine, "proof": self._proof(b"rank0", rank_nonce, self.mine)}  # fmt: skip

    def check_rank(self, answer: dict[str, Any]) -> None:
        expected = self._proof(b"rank", self.theirs, self.mine)
        if not hmac.compare_digest(expected, text(answer.get("proof"), 2 * MAC_SIZE)):
            raise ProtocolError("the rank did not prove it holds the group's token")

    def session(self, is_rank0: bool) -> Session:
        rank_nonce, rank0_nonce = (self.theirs, self.mine) if is_rank0 else (self.mine, self.theirs)
        parts = (b"pipeserve-session", self.context, rank_nonce.encode(), rank0_nonce.encode())
        key = _mac(self.token.encode(), *parts, str(self.rank).encode())
        return Session(key, b"0>r" if is_rank0 else b"r>0", b"r>0" if is_rank0 else b"0>r")


def parse_hello(data: dict[str, Any]) -> tuple[int, int, str]:
    """A rank's hello: (rank, pid, nonce); ProtocolError for anything else."""
    if data.get("v") != VERSION:
        raise ProtocolError(f"control hello of version {data.get('v')!r}, expected {VERSION}")
    return (
        int_in(data.get("rank"), 1, 1 << 16),
        int_in(data.get("pid"), 0, 1 << 31),
        _nonce(data.get("nonce")),
    )


class Session:
    """The MAC of every frame after the handshake: direction, sequence number, bytes."""

    def __init__(self, key: bytes, send_label: bytes, recv_label: bytes) -> None:
        self._key = key
        self._send = (send_label, 0)
        self._recv = (recv_label, 0)

    def seal(self, payload: bytes) -> bytes:
        label, seq = self._send
        self._send = (label, seq + 1)
        return payload + _mac(self._key, label, _SEQ.pack(seq), payload)

    def open(self, frame: bytes) -> bytes:
        if len(frame) < MAC_SIZE:
            raise ProtocolError("a control frame without its MAC")
        payload, tag = frame[:-MAC_SIZE], frame[-MAC_SIZE:]
        label, seq = self._recv
        if not hmac.compare_digest(tag, _mac(self._key, label, _SEQ.pack(seq), payload)):
            raise ProtocolError("a control frame with a wrong MAC (changed, replayed or forged)")
        self._recv = (label, seq + 1)
        return payload


# ---------------------------------------------------------------- rank 0's messages


def encode_message(message: tuple[Any, ...]) -> bytes:
    """One of rank 0's messages (start, ping, close, step) as its JSON frame."""
    kind = message[0]
    body: dict[str, Any] = {"v": VERSION, "kind": kind}
    if kind == "start":
        body["seed"] = int(message[1])
    elif kind == "step":
        body["step"] = int(message[1])
        body["changes"] = [_encode_change(change) for change in message[2]]
    elif kind not in ("ping", "close"):
        raise ProtocolError(f"no frame for control message {kind!r}")
    return encode_object(body)


def decode_message(data: bytes) -> tuple[Any, ...]:
    """A frame from rank 0 as the tuple lockstep.py replays; ProtocolError if malformed."""
    body = decode_object(data)
    if body.get("v") != VERSION:
        raise ProtocolError(f"control frame of version {body.get('v')!r}, expected {VERSION}")
    kind = body.get("kind")
    if kind == "start":
        return ("start", int_in(body.get("seed"), 0, 1 << 64))
    if kind in ("ping", "close"):
        return (kind,)
    if kind == "step":
        changes = array(body.get("changes"), "changes")
        return ("step", int_in(body.get("step"), 1, 1 << 62), [_decode_change(c) for c in changes])
    raise ProtocolError(f"unknown control message {str(kind)[:40]!r}")


def _encode_change(change: tuple[Any, ...]) -> dict[str, Any]:
    op = change[0]
    if op == "submit":
        _, key, job, spec, cached = change
        return {"op": "submit", "key": key, "job": encode_job(job),
                "spec": None if spec is None else list(spec), "cached": cached}  # fmt: skip
    if op == "cancel":
        return {"op": "cancel", "key": change[1]}
    if op == "prefix":
        return {"op": "prefix", "change": change[1], "count": change[2] if len(change) > 2 else None}  # fmt: skip
    raise ProtocolError(f"no frame for batch change {op!r}")


def _decode_change(raw: Any) -> tuple[Any, ...]:
    change = obj(raw, "change")
    op = change.get("op")
    if op == "submit":
        spec = change.get("spec")
        if spec is not None:
            items = array(spec, "spec")
            if len(items) != 3:
                raise ProtocolError("spec: expected [grammar, forced, optional]")
            spec = (text(items[0], TEXT), text(items[1], TEXT), boolean(items[2]))
        cached = change.get("cached")
        return ("submit", int_in(change.get("key"), 0, 1 << 62), decode_job(change.get("job")),
                spec, None if cached is None else int_in(cached, 0, 1 << 40))  # fmt: skip
    if op == "cancel":
        return ("cancel", int_in(change.get("key"), 0, 1 << 62))
    if op == "prefix":
        what = change.get("change")
        if what == "clear":
            return ("prefix", "clear")
        if what == "trim":
            return ("prefix", "trim", int_in(change.get("count"), 0, 1 << 40))
        raise ProtocolError(f"unknown prefix cache change {str(what)[:40]!r}")
    raise ProtocolError(f"unknown batch change {str(op)[:40]!r}")


# ---------------------------------------------------------------- typed fields


def _nonce(value: Any) -> str:
    nonce = text(value, 2 * NONCE_BYTES)
    if len(nonce) != 2 * NONCE_BYTES or any(c not in "0123456789abcdef" for c in nonce):
        raise ProtocolError("expected a nonce of 32 hex digits")
    return nonce


__all__ = [
    "HELLO_MAX",
    "VERSION",
    "Handshake",
    "ProtocolError",
    "Session",
    "decode_message",
    "decode_object",
    "encode_message",
    "parse_hello",
]
