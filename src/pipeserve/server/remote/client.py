"""A worker's side of the engine host: RemoteEngine, the Engine its stages see.

One HostClient per worker holds one Unix-socket connection to the host and one reader
greenlet that hands each frame's events to the waiting requests' channels (the same
Channel / EngineStream a local engine uses, so keep-alive pings, cancellation on an
abandoned stream and the event contract are the same). A submit waits for the host's
answer (accepted, or the engine's own rejection: 429 / 503 before any byte is sent).
When the connection breaks (the host died), every request in flight ends with an
in-protocol error event, Finish("error") and Usage; the next request reconnects to
the restarted host, waiting up to CONNECT_WAIT seconds for it.

A status question (/health, /v1/models, /metrics) never waits for that: it makes one
attempt of its own when no request is connecting, else answers "down" at once. Nor does
it wait for a slow host: a new answer is waited for STATUS_FRESH_WAIT seconds, then the
last one (at most STATUS_STALE seconds old) stands in; only without any recent answer
does it wait, at most `status_wait` seconds.
"""

from __future__ import annotations

import itertools
import logging
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gevent
import gevent.event
import gevent.lock

from pipeserve.engine.base import GenerationJob
from pipeserve.engine.output.channel import Channel
from pipeserve.engine.output.stream import EngineStream
from pipeserve.engine.sharding.control import Connection
from pipeserve.errors import ApiError
from pipeserve.events import ErrorEvent, Event, Finish, PromptReady, TokenText, Usage
from pipeserve.server.fleet import FleetView
from pipeserve.server.remote.wire import (
    HANDSHAKE_WAIT,
    MAX_FRAME,
    api_error,
    decode_batch,
    encode_request,
    outbound_job,
    worker_handshake,
)
from pipeserve.wire_schema import ProtocolError

log = logging.getLogger("pipeserve.enginehost")
CONNECT_WAIT = 10.0  # seconds a request waits for a (restarting) host to accept it
CONNECT_RETRY = 0.2
STATUS_TTL = 0.1  # seconds a status answer is reused (one /metrics or /health answer)
STATUS_STALE = 2.0  # seconds the last answer stands in while a newer one is on its way
STATUS_FRESH_WAIT = 0.2  # seconds a poll waits for the newer answer before that
STATUS_WAIT = 5.0
SUBMIT_WAIT = 600.0  # a submit may wait for a reload or a grammar compilation


@dataclass
class RemoteJob:
    """A request in flight on the host, as much as ending it well needs."""

    channel: Channel
    prompt_tokens: int
    started: bool = False
    completion_tokens: int = 0

    def deliver(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, PromptReady):
                self.started = True
            elif isinstance(event, TokenText):
                self.completion_tokens += 1
        self.channel._queue.put(events)

    def fail(self, message: str) -> None:
        events: list[Event] = [] if self.started else [PromptReady(self.prompt_tokens)]
        events += [
            ErrorEvent("unavailable", message),
            Finish("error"),
            Usage(self.prompt_tokens, self.completion_tokens),
        ]
        self.channel._queue.put(events)


class HostClient:
    """This worker's connection to the engine host (made on first use, remade after a loss)."""

    def __init__(self, socket_path: Path, secret: str, status_wait: float = STATUS_WAIT) -> None:
        self.socket_path = socket_path
        self.secret = secret  # the server's (wire.py): the host proves it holds it, and we
        self.status_wait = status_wait
        self.down_reason = "the engine host is starting"
        self._sock: Connection | None = None
        self._jobs: dict[int, RemoteJob] = {}
        self._replies: dict[int, gevent.event.AsyncResult] = {}
        self._keys = itertools.count(1)
        self._send_lock = gevent.lock.Semaphore()
        self._connect_lock = gevent.lock.Semaphore()
        self._opening: gevent.Greenlet | None = None  # a status poll's connect, in flight
        self._status: tuple[float, dict[str, Any] | None] | None = None
        self._status_question: gevent.event.AsyncResult | None = None  # in flight
        self._status_asked_at = 0.0

    # -- requests -------------------------------------------------------------------

    def submit(self, model: str, job: GenerationJob) -> EngineStream:
        sock = self._connect(CONNECT_WAIT)
        key = next(self._keys)
        channel = Channel()
        self._jobs[key] = RemoteJob(channel, len(job.prompt_token_ids))
        outbound, spec = outbound_job(job)
        try:
            answer = self._ask(sock, key, ("submit", key, model, outbound, spec), SUBMIT_WAIT)
        except BaseException:
            self._jobs.pop(key, None)
            self._send_quietly(("cancel", key))  # it may have started on the host
            raise
        if answer is not None:
            self._jobs.pop(key, None)
            raise api_error(answer)
        return EngineStream(
            channel, lambda: self._send_quietly(("cancel", key)), job.keepalive_interval
        )

    def fleet_view(self) -> FleetView:
        """The engine host's fleet for /metrics (empty while it cannot be reached)."""
        status = self.status()
        return status["fleet"] if status is not None else FleetView()

    def status(self) -> dict[str, Any] | None:
        """{"models": health, residency and stats by model key, "fleet": FleetView}; None
        when the host cannot be reached (self.down_reason says why). See the module doc:
        it waits neither for a request's connect nor, with a recent answer, for the host."""
        cached = self._status
        now = time.monotonic()
        if cached is not None and now - cached[0] < STATUS_TTL:
            return cached[1]
        question = self._ask_status()
        if question is None:
            self._status = (now, None)
            return None
        if cached is not None and cached[1] is not None and now - cached[0] < STATUS_STALE:
            # A fresh answer usually comes within milliseconds (a lost model must show at
            # once); the last one stands in only while the host is slow to answer.
            try:
                fresh: dict[str, Any] = question.get(timeout=STATUS_FRESH_WAIT)
                return fresh
            except gevent.Timeout:
                return cached[1]
            except ApiError:
                self._status = (time.monotonic(), None)
                return None
        left = self._status_asked_at + self.status_wait - now  # waited for once, not per poll
        try:
            answer: dict[str, Any] = question.get(timeout=max(0.0, left))
        except gevent.Timeout:
            self.down_reason = f"the engine host did not answer within {self.status_wait:g} s"
            self._status = (time.monotonic(), None)
            return None
        except ApiError:
            self._status = (time.monotonic(), None)
            return None
        return answer

    def _ask_status(self) -> gevent.event.AsyncResult | None:
        """The status question in flight, sent now unless one is; None: no connection."""
        question = self._status_question
        if question is not None and not question.ready():
            return question
        try:
            sock = self._connect_now()
        except ApiError:
            return None
        key = next(self._keys)
        question = gevent.event.AsyncResult()
        self._replies[key] = question
        question.rawlink(lambda done: self._status_answered(key, done))
        self._status_question = question
        self._status_asked_at = time.monotonic()
        try:
            self._send(sock, ("status", key))
        except ApiError:
            self._replies.pop(key, None)
            return None
        return question

    def _status_answered(self, key: int, done: gevent.event.AsyncResult) -> None:
        self._replies.pop(key, None)
        if done.successful():
            self.down_reason = ""
            self._status = (time.monotonic(), done.value)

    def _ask(self, sock: Connection, key: int, message: Any, timeout: float) -> Any:
        result = gevent.event.AsyncResult()
        self._replies[key] = result
        try:
            self._send(sock, message)
            return result.get(timeout=timeout)
        except gevent.Timeout:
            self.down_reason = f"the engine host did not answer within {timeout:.0f} s"
            raise ApiError("unavailable", self.down_reason, retry_after=1) from None
        finally:
            self._replies.pop(key, None)

    # -- the connection ---------------------------------------------------------------

    def _connect(self, wait: float) -> Connection:
        deadline = time.monotonic() + wait
        with self._connect_lock:
            while self._sock is None:
                try:
                    self._open(HANDSHAKE_WAIT)
                except OSError as exc:
                    self.down_reason = f"the engine host is not running ({exc.strerror or exc})"
                    if time.monotonic() >= deadline:
                        raise ApiError(
                            "unavailable",
                            f"{self.down_reason}; it restarts automatically, retry shortly",
                            retry_after=2,
                        ) from None
                    gevent.sleep(CONNECT_RETRY)
            return self._sock

    def _connect_now(self) -> Connection:
        """The connection, or one attempt to open it; never waits for the connect lock
        (a request may hold it for CONNECT_WAIT seconds while the host restarts), nor
        longer than status_wait for the host's handshake, which goes on in the
        background (a later poll finds the connection made, even where a handshake
        takes longer than one poll's wait)."""
        sock = self._sock
        if sock is not None:
            return sock
        opening = self._opening
        if opening is None or opening.ready():
            if not self._connect_lock.acquire(blocking=False):
                raise ApiError("unavailable", self.down_reason or "the engine host is restarting")
            opening = self._opening = gevent.spawn(self._open_in_background)
        opening.join(timeout=self.status_wait)
        if self._sock is None:
            raise ApiError("unavailable", self.down_reason or "connecting to the engine host")
        return self._sock

    def _open_in_background(self) -> None:
        """One attempt to open the connection, holding the connect lock (taken for it)."""
        try:
            if self._sock is None:
                self._open(HANDSHAKE_WAIT)
        except OSError as exc:
            self.down_reason = f"the engine host is not running ({exc.strerror or exc})"
        finally:
            self._connect_lock.release()

    def _open(self, wait: float) -> None:
        """Connect and shake hands (wire.py): a host that cannot prove it holds the
        server's secret is left at once (OSError: it is treated as not running)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn = Connection(sock, MAX_FRAME, "engine host wire", self._send_lock)
        try:
            sock.connect(str(self.socket_path))
            worker_handshake(conn, self.secret, wait)
        except ProtocolError as exc:
            conn.close()
            log.error("engine host: %s", exc)
            raise OSError(f"the engine host's handshake failed: {exc}") from None
        except OSError:
            conn.close()
            raise
        self._sock = conn
        self.down_reason = ""
        gevent.spawn(self._read_loop, conn)

    def _send(self, sock: Connection, message: Any) -> None:
        try:
            sock.send_bytes(encode_request(message))
        except OSError:
            self._lost(sock, "the engine host connection broke")
            raise ApiError(
                "unavailable", "the engine host is not reachable", retry_after=2
            ) from None

    def _send_quietly(self, message: Any) -> None:
        sock = self._sock
        if sock is not None:
            try:
                self._send(sock, message)
            except ApiError:  # the host is gone: the job ended with it
                pass

    def _read_loop(self, sock: Connection) -> None:
        try:
            while True:
                self._dispatch(decode_batch(sock.recv_bytes()))
        except OSError:  # the host is gone (or a frame's MAC was wrong)
            pass
        except ProtocolError as exc:
            log.error("engine host connection: a malformed frame (%s)", exc)
        except Exception:  # a bug here must not leave requests hanging
            log.exception("engine host connection: unreadable message")
        self._lost(sock, "the model engine process stopped; it is being restarted")

    def _dispatch(self, message: tuple[Any, ...]) -> None:
        _, replies, events = message
        for key, value in replies:
            waiter = self._replies.get(key)
            if waiter is not None:
                waiter.set(value)
        for key, batch in events:
            job = self._jobs.get(key)
            if job is None:
                continue
            job.deliver(batch)
            if isinstance(batch[-1], Usage):
                del self._jobs[key]

    def _lost(self, sock: Connection, reason: str) -> None:
        if self._sock is not sock:
            return  # already handled
        self._sock = None
        self._status = None  # no stale answer stands in for a host that is gone
        self.down_reason = reason
        log.error("engine host: %s; failing %d requests in flight", reason, len(self._jobs))
        sock.close()
        jobs, self._jobs = self._jobs, {}
        for job in jobs.values():
            job.fail(reason)
        error = ApiError("unavailable", reason, retry_after=2)
        for waiter in list(self._replies.values()):
            waiter.set_exception(error)


class RemoteEngine:
    """One model's engine in the engine host, as seen from a worker."""

    def __init__(
        self,
        name: str,
        key: str,
        client: HostClient,
        *,
        accepts_mock_response: bool,
        max_tokens_limit: int | None,
        load: str = "startup",
    ) -> None:
        self.name = name
        self.load = load  # the entry's load policy, for /v1/models while the host is down
        self.key = key
        self.client = client
        self.accepts_mock_response = accepts_mock_response
        self.max_tokens_limit = max_tokens_limit

    def submit(self, job: GenerationJob) -> EngineStream:
        return self.client.submit(self.key, job)

    def _status(self) -> dict[str, Any] | None:
        status = self.client.status()
        return None if status is None else status["models"].get(self.key)

    def stats(self) -> dict[str, float]:
        status = self._status()
        return dict(status["stats"]) if status is not None else {}

    @property
    def healthy(self) -> bool:
        status = self._status()
        return status is not None and bool(status["healthy"])

    @property
    def health_reason(self) -> str:
        status = self._status()
        if status is None:
            return self.client.down_reason or f"model {self.name} is not in the engine host"
        return str(status["reason"])

    def describe(self) -> dict[str, Any]:
        status = self._status()
        if status is None:
            return {"state": "not-loaded", "load": self.load, "memory_bytes": 0}
        return dict(status["describe"])

    def close(self) -> None:
        """The host owns the engine; a worker stopping leaves it running."""
