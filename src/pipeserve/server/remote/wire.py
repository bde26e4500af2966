"""The engine host's wire: MACed JSON frames in a fixed schema over a Unix socket.

Nothing on this wire is ever unpickled. The socket lies in a folder only the server's
user can enter (0700) and the host accepts only that user's processes (SO_PEERCRED);
in depth behind that, a process that reaches the socket anyway gets nothing without
the server's secret (made by the master at start, inherited by the forked workers,
handed to the host on its stdin; never on a command line, in the environment or on
disk):

- A connection starts with the control channel's mutual challenge-response
  (engine/sharding/frames.Handshake, in this wire's own context): the worker sends a
  nonce, the host proves it holds the secret, the worker proves it does; neither sends
  the secret. The hello is read within HELLO_MAX bytes and HANDSHAKE_WAIT seconds, at
  most MAX_HANDSHAKES at a time; a worker also refuses a "host" that cannot prove it.
- Every later frame carries an HMAC-SHA256 over its direction, its sequence number and
  its bytes (frames.Session), checked before it is parsed: a frame changed, replayed,
  reordered or reflected ends the connection.
- Frames are a 4-byte length and a payload (engine/sharding/control.Connection),
  refused unread above MAX_FRAME; each payload is one JSON object of VERSION whose
  every field is type-checked (pipeserve.wire_schema), a ProtocolError otherwise.

Messages, decoded into the tuples the client and the host use:

worker -> host
    ("submit", key, model_key, job, spec)   spec: (grammar, forced, optional) or None
    ("cancel", key)
    ("status", key)
host -> worker, one frame per flush (normally one per engine step):
    ("batch", replies, events)
        replies: [(key, None | rejection | status)], a submit's answer or a status
        events:  [(key, [Event, ...])]
A rejection is (kind, message, param, retry_after, code): an ApiError's fields.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pickle
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, get_args

from pipeserve.config.models import ModelEntry
from pipeserve.engine.base import GenerationJob
from pipeserve.engine.sharding.control import Connection
from pipeserve.engine.sharding.frames import HELLO_MAX, Handshake, parse_hello
from pipeserve.errors import DEFAULT_STATUS, ApiError
from pipeserve.events import (
    ContentDelta,
    ErrorEvent,
    Event,
    Finish,
    FinishReason,
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
from pipeserve.server.fleet import FleetView
from pipeserve.wire_schema import (
    INT64,
    ProtocolError,
    array,
    boolean,
    decode_job,
    decode_object,
    encode_job,
    encode_object,
    fixed,
    int64,
    int_in,
    number,
    obj,
    optional_number,
    optional_text,
    text,
)

VERSION = 1
MAX_FRAME = 256 << 20  # a submit carries a whole prompt and grammar; a batch a step's events
HANDSHAKE_WAIT = 10.0  # seconds for a connection's whole handshake
MAX_HANDSHAKES = 32  # connections in their handshake at once; more are closed at once
CONTEXT = b"pipeserve-engine-host"
WORKER_RANK = 1  # the handshake's "rank": every worker is the connecting side
SECRET_BYTES = 32
SNAPSHOT_MAC = 32
ConstraintSpec = tuple[str, str, bool]
Rejection = tuple[str, str, str | None, float | None, str | None]
_KEY = (0, 1 << 62)


def new_secret() -> str:
    """A server's secret for this wire (hex): the master makes one at start."""
    return os.urandom(SECRET_BYTES).hex()


# ---------------------------------------------------------------- the handshake


def worker_handshake(conn: Connection, secret: str, wait: float = HANDSHAKE_WAIT) -> None:
    """The worker's side: prove we hold the secret and check that the host does; then
    every frame on `conn` is MACed. ProtocolError, ChannelClosed or TimeoutError else."""
    shake = Handshake(secret, WORKER_RANK, context=CONTEXT)
    conn.send_json(shake.hello(os.getpid()))
    conn.send_json(shake.answer_rank0(conn.recv_json(wait, HELLO_MAX)))
    conn.session = shake.session(is_rank0=False)
    conn.sock.settimeout(None)


def host_handshake(conn: Connection, secret: str) -> None:
    """The host's side, within HANDSHAKE_WAIT seconds for the whole exchange."""
    shake = Handshake(secret, WORKER_RANK, context=CONTEXT)
    deadline = _Deadline(HANDSHAKE_WAIT)
    rank, _, nonce = parse_hello(conn.recv_json(deadline.left(), HELLO_MAX))
    if rank != WORKER_RANK:
        raise ProtocolError(f"an engine host hello for rank {rank}")
    conn.send_json(shake.challenge(nonce))
    shake.check_rank(conn.recv_json(deadline.left(), HELLO_MAX))
    conn.session = shake.session(is_rank0=True)
    conn.sock.settimeout(None)


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self._end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.001, self._end - time.monotonic())


# ---------------------------------------------------------------- worker -> host


def encode_request(message: tuple[Any, ...]) -> bytes:
    kind, key = message[0], message[1]
    body: dict[str, Any] = {"v": VERSION, "kind": kind, "key": key}
    if kind == "submit":
        _, _, model, job, spec = message
        body.update(model=model, job=encode_job(job), spec=None if spec is None else list(spec))
    elif kind not in ("cancel", "status"):
        raise ProtocolError(f"no engine host frame for {kind!r}")
    return encode_object(body)


def decode_request(data: bytes) -> tuple[Any, ...]:
    body = _versioned(data)
    kind, key = body.get("kind"), int_in(body.get("key"), *_KEY)
    if kind in ("cancel", "status"):
        return (kind, key)
    if kind != "submit":
        raise ProtocolError(f"unknown engine host request {str(kind)[:40]!r}")
    spec = body.get("spec")
    if spec is not None:
        grammar, forced, optional = fixed(spec, "spec", 3)
        spec = (text(grammar), text(forced), boolean(optional))
    return ("submit", key, text(body.get("model"), 64), decode_job(body.get("job")), spec)


def outbound_job(job: GenerationJob) -> tuple[GenerationJob, ConstraintSpec | None]:
    """The job without its grammar matcher (it cannot cross processes), and what
    rebuilds it."""
    constraint = job.constraint
    if constraint is None:
        return job, None
    return replace(job, constraint=None), (
        constraint.grammar,
        constraint.forced,
        constraint.optional,
    )


# ---------------------------------------------------------------- host -> worker


def encode_batch(replies: list[tuple[int, Any]], events: list[tuple[int, list[Event]]]) -> bytes:
    return encode_object({
        "v": VERSION,
        "kind": "batch",
        "replies": [_encode_reply(key, value) for key, value in replies],
        "events": [[key, [_encode_event(e) for e in batch]] for key, batch in events],
    })  # fmt: skip


def decode_batch(data: bytes) -> tuple[Any, ...]:
    body = _versioned(data)
    if body.get("kind") != "batch":
        raise ProtocolError(f"unknown engine host message {str(body.get('kind'))[:40]!r}")
    replies = [_decode_reply(r) for r in array(body.get("replies"), "replies")]
    events = []
    for item in array(body.get("events"), "events"):
        key, batch = fixed(item, "events", 2)
        decoded = [_decode_event(e) for e in array(batch, "events")]
        if not decoded:
            raise ProtocolError("events: an empty batch")
        events.append((int_in(key, *_KEY), decoded))
    return ("batch", replies, events)


def _versioned(data: bytes) -> dict[str, Any]:
    body = decode_object(data, "engine host frame")
    if body.get("v") != VERSION:
        raise ProtocolError(f"engine host frame of version {body.get('v')!r}, expected {VERSION}")
    return body


def _encode_reply(key: int, value: Any) -> dict[str, Any]:
    if value is None:
        return {"key": key, "accepted": True}
    if isinstance(value, tuple):
        kind, message, param, retry_after, code = value
        return {"key": key, "rejected": {"kind": kind, "message": message, "param": param,
                                         "retry_after": retry_after, "code": code}}  # fmt: skip
    return {"key": key, "status": _encode_status(value)}


def _decode_reply(raw: Any) -> tuple[int, Any]:
    reply = obj(raw, "reply")
    key = int_in(reply.get("key"), *_KEY)
    if reply.get("accepted") is True and len(reply) == 2:
        return key, None
    if "rejected" in reply and len(reply) == 2:
        r = obj(reply["rejected"], "rejected")
        kind = text(r.get("kind"), 32)
        if kind not in DEFAULT_STATUS:
            raise ProtocolError(f"rejected: unknown error kind {kind!r}")
        rejection: Rejection = (kind, text(r.get("message")), optional_text(r.get("param")),
                                optional_number(r.get("retry_after")), optional_text(r.get("code")))  # fmt: skip
        return key, rejection
    if "status" in reply and len(reply) == 2:
        return key, _decode_status(reply["status"])
    raise ProtocolError("reply: expected accepted, rejected or status")


# ---------------------------------------------------------------- events

_TAGS: dict[type, str] = {TokenText: "t", PromptReady: "p", ContentDelta: "c",
                          ReasoningDelta: "r", ToolCallStart: "ts", ToolCallArgsDelta: "ta",
                          ToolCallEnd: "te", Finish: "f", Usage: "u", ErrorEvent: "e",
                          KeepAlive: "k"}  # fmt: skip
_FIELDS = {cls: tuple(f.name for f in fields(cls)) for cls in _TAGS}
_REASONS = frozenset(get_args(FinishReason))


def _count(value: Any) -> int:
    return int_in(value, 0, 1 << 62)


def _index(value: Any) -> int:
    return int_in(value, 0, 1 << 31)


def _reason(value: Any) -> str:
    if not isinstance(value, str) or value not in _REASONS:
        raise ProtocolError(f"finish: unknown reason {str(value)[:40]!r}")
    return str(value)


def _top(value: Any) -> tuple[TopLogprob, ...]:
    out = []
    for item in array(value, "top_logprobs"):
        token, logprob, token_id = fixed(item, "top_logprobs", 3)
        out.append(TopLogprob(text(token), number(logprob), int64(token_id)))
    return tuple(out)


# Each event's fields in order, each with its check (the class's own order and types).
_CHECKS: dict[str, tuple[type, tuple[Any, ...]]] = {
    "t": (TokenText, (text, int64, optional_number, _top)),
    "p": (PromptReady, (_count, _count)),
    "c": (ContentDelta, (text,)),
    "r": (ReasoningDelta, (text,)),
    "ts": (ToolCallStart, (_index, text, text)),
    "ta": (ToolCallArgsDelta, (_index, text)),
    "te": (ToolCallEnd, (_index, text)),
    "f": (Finish, (_reason, optional_text)),
    "u": (Usage, (_count,) * 8),
    "e": (ErrorEvent, (lambda v: text(v, 64), text)),
    "k": (KeepAlive, ()),
}


def _encode_event(event: Event) -> list[Any]:
    if isinstance(event, TokenText):
        top = [[t.token, t.logprob, t.token_id] for t in event.top_logprobs]
        return ["t", event.text, event.token_id, event.logprob, top]
    cls = type(event)
    return [_TAGS[cls], *(getattr(event, name) for name in _FIELDS[cls])]


def _decode_event(raw: Any) -> Event:
    items = array(raw, "event")
    if len(items) == 5 and items[0] == "t" and not items[4]:  # the common case, checked inline
        _, text_, token_id, logprob, _ = items
        if type(text_) is str and type(token_id) is int and INT64[0] <= token_id < INT64[1]:
            return TokenText(text_, token_id, optional_number(logprob))
    if not items or not isinstance(items[0], str) or items[0] not in _CHECKS:
        raise ProtocolError(f"event: unknown kind {str(items[:1])[:40]}")
    cls, checks = _CHECKS[items[0]]
    if len(items) != 1 + len(checks):
        raise ProtocolError(f"event {items[0]!r}: expected {len(checks)} fields")
    event: Event = cls(*(check(value) for check, value in zip(checks, items[1:], strict=True)))
    return event


# ---------------------------------------------------------------- a status answer


def _encode_status(status: dict[str, Any]) -> dict[str, Any]:
    view: FleetView = status["fleet"]
    out = {
        "models": status["models"],
        "fleet": {
            "models": [list(m) for m in view.models],
            "resident": view.resident,
            "peak_resident": view.peak_resident,
            "resident_bytes": view.resident_bytes,
            "budget": view.budget,
            "loads": view.loads,
            "unloads": [[a, b, n] for (a, b), n in view.unloads.items()],
        },
    }
    if "cluster" in status:
        out["cluster"] = status["cluster"]
    return out


def _decode_status(raw: Any) -> dict[str, Any]:
    """{"models": {key: {healthy, reason, describe, stats}}, "fleet": FleetView,
    "cluster"?: GET /v1/cluster's part}: describe and cluster are plain JSON objects
    (shown to clients as they are), the rest typed."""
    status = obj(raw, "status")
    models = {}
    for key, value in obj(status.get("models"), "models").items():
        model = obj(value, "model status")
        stats = obj(model.get("stats"), "stats")
        models[text(key, 64)] = {
            "healthy": boolean(model.get("healthy")),
            "reason": text(model.get("reason")),
            "describe": obj(model.get("describe"), "describe"),
            "stats": {text(name, 128): number(v) for name, v in stats.items()},
        }
    out: dict[str, Any] = {"models": models, "fleet": _decode_fleet(status.get("fleet"))}
    if "cluster" in status:
        out["cluster"] = obj(status["cluster"], "cluster")
    return out


def _decode_fleet(raw: Any) -> FleetView:
    fleet = obj(raw, "fleet")
    models = []
    for item in array(fleet.get("models"), "fleet models"):
        name, loaded, size = fixed(item, "fleet models", 3)
        models.append((text(name), boolean(loaded), _count(size)))
    budget = fleet.get("budget")
    unloads = {}
    for item in array(fleet.get("unloads"), "unloads"):
        name, why, n = fixed(item, "unloads", 3)
        unloads[(text(name), text(why))] = _count(n)
    return FleetView(
        models=models,
        resident=_count(fleet.get("resident")),
        peak_resident=_count(fleet.get("peak_resident")),
        resident_bytes=_count(fleet.get("resident_bytes")),
        budget=None if budget is None else _count(budget),
        loads={text(k): _count(v) for k, v in obj(fleet.get("loads"), "loads").items()},
        unloads=unloads,
    )


# ---------------------------------------------------------------- the config snapshot


def write_sealed(path: Path, loaded: Any, secret: str) -> None:
    """The master's config for the workers and hosts (reload.Snapshot): pickled (it is
    made and read by this server's own processes), behind an HMAC on the server's secret
    that `read_sealed` checks before unpickling, so a file put in its place by anyone
    without the secret is refused, never unpickled."""
    data = pickle.dumps(loaded)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(_snapshot_mac(secret, data) + data)
    os.replace(tmp, path)


def read_sealed(path: Path, secret: str) -> Any:
    raw = path.read_bytes()
    tag, data = raw[:SNAPSHOT_MAC], raw[SNAPSHOT_MAC:]
    if not hmac.compare_digest(tag, _snapshot_mac(secret, data)):
        raise ProtocolError(f"{path}: the config snapshot's MAC is wrong (not this server's)")
    return pickle.loads(data)


def _snapshot_mac(secret: str, data: bytes) -> bytes:
    return hmac.new(secret.encode(), b"pipeserve-snapshot\0" + data, hashlib.sha256).digest()


# ---------------------------------------------------------------- errors, keys


def rejection(error: ApiError) -> Rejection:
    return (error.kind, error.message, error.param, error.retry_after, error.code)


def api_error(fields: Rejection) -> ApiError:
    kind, message, param, retry_after, code = fields
    return ApiError(kind, message, param, retry_after, code)  # type: ignore[arg-type]


def model_key(entry: ModelEntry) -> str:
    """What identifies one engine across processes: everything that, if changed, needs
    the model reloaded (source, engine, options, load policy), not its pipeline or
    aliases. A reload that changes it makes a new engine; the old key keeps serving the
    requests that were routed to it."""
    facts = json.dumps(entry.model_dump(exclude={"aliases", "pipeline"}), sort_keys=True)
    return hashlib.sha256(facts.encode()).hexdigest()[:24]
