"""The engine host's wire: length-prefixed pickle frames over a Unix socket.

Both ends are processes of this server run by the same user, and the socket lies in a
folder only that user can enter (0700), so pickle is safe here and keeps events and
jobs as they are (frozen dataclasses). Messages are tuples:

worker -> host
    ("submit", key, model_key, job, constraint)   constraint: (grammar, forced, optional)
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
import json
import pickle
import socket
import struct
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, BinaryIO

from pipeserve.config.models import ModelEntry
from pipeserve.engine.base import GenerationJob
from pipeserve.errors import ApiError

HEADER = struct.Struct("!I")
ConstraintSpec = tuple[str, str, bool]
Rejection = tuple[str, str, str | None, float | None, str | None]


def send_frame(sock: socket.socket, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(HEADER.pack(len(data)) + data)


def frames(stream: BinaryIO) -> Iterator[Any]:
    """Messages read from a socket's file until it ends (EOF or a torn frame)."""
    while True:
        header = stream.read(HEADER.size)
        if len(header) < HEADER.size:
            return
        (size,) = HEADER.unpack(header)
        body = stream.read(size)
        if len(body) < size:
            return
        yield pickle.loads(body)


def outbound_job(job: GenerationJob) -> tuple[GenerationJob, ConstraintSpec | None]:
    """The job without its grammar matcher (not picklable), and what rebuilds it."""
    constraint = job.constraint
    if constraint is None:
        return job, None
    return replace(job, constraint=None), (
        constraint.grammar,
        constraint.forced,
        constraint.optional,
    )


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
