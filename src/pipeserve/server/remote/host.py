"""The engine host: one process that runs every model's engine for all gunicorn workers.

Started by the master (supervisor.py) as `python -m pipeserve.server.remote.host`. It
runs under gevent like a worker: the engines' OS threads hand each step's events to
its hub (engine/output/channel.py), a greenlet per job forwards them to the job's connection,
and one writer greenlet per connection sends what a step produced for that worker in
one frame. The models are a Fleet of ManagedEngines, as in a single worker: load on
demand, the memory budget (the whole budget: there is one copy), keep_alive, and
reloads (SIGHUP: apply the master's config snapshot) work as with one worker.

A sharded model runs in a host of its own (`--only NAME`, a "shard host"; the engine
host and the workers leave it out): losing its group ends this process (an
mx.distributed group cannot be joined twice in one), and the master starts a fresh one
that places the model again, while the workers and the other models keep serving. A
shard host answers at once and places its model in the background, retrying with
backoff while it cannot (machines unreachable); meanwhile its model reports itself
unavailable with the reason, and requests for it get a 503 saying so.

Signals: SIGTERM and SIGINT are ignored (a terminal's Ctrl-C or a service manager
signals the whole process group, and the workers still draining need the engines);
the master sends SIGUSR1 to stop the host once its workers have stopped, and the host
also stops when the master is gone.
"""

from __future__ import annotations

from gevent import monkey

if __name__ == "__main__":  # before anything imports socket, threading or queue
    monkey.patch_all()

import argparse
import logging
import logging.config
import os
import signal
import socket
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import gevent
import gevent.event
import gevent.lock
from gevent.server import StreamServer

from pipeserve.config.config_checks import LoadedConfig
from pipeserve.config.memory import budget_bytes
from pipeserve.engine.base import ModelRuntime, TokenStream
from pipeserve.engine.sampling.grammar import GrammarError
from pipeserve.engine.sharding.control import Connection
from pipeserve.errors import ApiError
from pipeserve.events import Event, KeepAlive
from pipeserve.gevent_support import run_off_hub
from pipeserve.server.fleet import Fleet
from pipeserve.server.remote.chat_activity import (
    ChatActivityWriter,
    activity_path,
    publish_forever,
)
from pipeserve.server.remote.wire import (
    MAX_FRAME,
    MAX_HANDSHAKES,
    SECRET_BYTES,
    ConstraintSpec,
    decode_request,
    encode_batch,
    host_handshake,
    model_key,
    read_sealed,
    rejection,
)
from pipeserve.wire_schema import ProtocolError

log = logging.getLogger("pipeserve.enginehost")
PARENT_POLL = 1.0
PLACE_RETRY_FIRST = 2.0
PLACE_RETRY_MAX = 15.0
SPENT_POLL = 0.5


class HostedModels:
    """The host's engines by model key; retired ones serve their requests until idle."""

    def __init__(self) -> None:
        self.fleet = Fleet()
        self.runtimes: dict[str, ModelRuntime] = {}
        self.tokenizers: dict[Path, Any] = {}
        self.applied = gevent.event.Event()  # clear while a reload is being applied
        self.placing: dict[str, str] = {}  # shard host: model key -> why it is not served yet

    def apply(self, loaded: LoadedConfig) -> None:
        from pipeserve.engine.runtime import build_runtime, draft_entry

        self.applied.clear()
        try:
            server = loaded.config.server
            self.fleet.budget = budget_bytes(server.memory_budget, 1)
            self.fleet.room_timeout = server.request_timeout
            current: dict[str, ModelRuntime] = {}
            for entry in loaded.config.models:
                if entry.kind != "generation":  # embedding models run in each worker
                    continue
                key = model_key(entry)
                runtime = self.runtimes.get(key)
                if runtime is None or managed(runtime).retired:
                    draft = draft_entry(loaded.config.models, entry)
                    manage, tokenizers = self.fleet.manager_for(entry, draft), self.tokenizers
                    runtime = run_off_hub(partial(build_runtime, entry, manage, tokenizers, draft))
                current[key] = runtime
            for runtime in current.values():
                engine = managed(runtime)
                if engine.pinned and engine.engine is None:
                    self.fleet.load_now(engine)
            gone = [managed(r) for k, r in self.runtimes.items() if k not in current]
            self.fleet.set_current([managed(r) for r in current.values()], gone)
            retiring = {id(e) for e in self.fleet.retiring}
            kept = {k: r for k, r in self.runtimes.items() if id(managed(r)) in retiring}
            self.runtimes = kept | current
            log.info("engine host: serving %s", ", ".join(r.name for r in current.values()))
        finally:
            self.applied.set()

    def submit(self, key: str, job: Any, spec: ConstraintSpec | None) -> TokenStream:
        if key in self.placing:
            raise ApiError("unavailable", self.placing[key], retry_after=5)
        runtime = self.runtimes.get(key)
        if runtime is None and not self.applied.is_set():  # a reload is being applied
            self.applied.wait()
            runtime = self.runtimes.get(key)
        if runtime is None:
            raise ApiError(
                "unavailable", "this model was replaced by a config reload; retry", retry_after=1
            )
        if spec is not None:
            job.constraint = constraint(runtime, spec)
        stream: TokenStream = managed(runtime).submit(job)
        return stream

    def status(self) -> dict[str, Any]:
        """Each model's health, residency and stats by key, and the fleet's view."""
        models = {}
        for key, runtime in self.runtimes.items():
            engine = managed(runtime)
            models[key] = {
                "healthy": engine.healthy,
                "reason": engine.health_reason,
                "describe": engine.describe(),
                "stats": engine.stats(),
            }
        for key, reason in self.placing.items():
            describe = {"state": "loading", "load": "startup", "memory_bytes": 0}
            models[key] = {"healthy": False, "reason": reason, "describe": describe, "stats": {}}
        out = {"models": models, "fleet": self.fleet.view()}
        if "pipeserve.cluster.launch" in sys.modules:  # a model placed on pipeserve nodes
            from pipeserve.cluster.launch import cluster_view

            out["cluster"] = cluster_view()
        return out

    def active_sequences(self) -> int:
        """Sequences the host's engines decode now (the workers' embedding engines give
        way to them: chat_activity.py)."""
        return sum(int(e.stats().get("active_sequences", 0)) for e in self.fleet.all_engines())

    def reap_gone(self) -> None:
        """Forget retired runtimes once the fleet has unloaded and dropped them."""
        alive = {id(e) for e in self.fleet.all_engines()}
        self.runtimes = {k: r for k, r in self.runtimes.items() if id(managed(r)) in alive}


def managed(runtime: ModelRuntime) -> Any:
    from pipeserve.server.managed_engine import ManagedEngine

    engine = runtime.engine
    assert isinstance(engine, ManagedEngine)
    return engine


def constraint(runtime: ModelRuntime, spec: ConstraintSpec) -> Any:
    """Rebuild a job's grammar constraint here (matchers cannot cross processes)."""
    compiler = runtime.grammar
    grammar, forced, optional = spec
    if compiler is None:
        raise ApiError("invalid_request", "structured output is not available for this model.")
    try:
        return run_off_hub(lambda: compiler.constraint(grammar, forced, optional))
    except GrammarError as exc:
        raise ApiError("invalid_request", f"invalid grammar: {exc}") from None


class WorkerConnection:
    """One gunicorn worker's connection: its jobs, and one frame per flush back to it."""

    def __init__(self, conn: Connection, models: HostedModels) -> None:
        self.conn = conn
        self.models = models
        self.streams: dict[int, TokenStream] = {}
        self.cancelled: set[int] = set()
        self._replies: list[tuple[int, Any]] = []
        self._events: dict[int, list[Event]] = {}
        self._wake = gevent.event.Event()
        self._open = True

    def serve(self) -> None:
        writer = gevent.spawn(self._write_loop)
        try:
            while True:
                self._handle(decode_request(self.conn.recv_bytes()))
        except OSError:  # the worker went away (or sent a frame without a valid MAC)
            pass
        except ProtocolError as exc:  # a bug on the worker's side: it reconnects
            log.error("engine host: a worker sent a malformed frame (%s); closing", exc)
        finally:
            self.conn.close()
            self._open = False
            for stream in list(self.streams.values()):  # the worker is gone: free the slots
                stream.cancel()
            self._wake.set()
            writer.join(timeout=5)

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind, key = message[0], message[1]
        if kind == "submit":
            gevent.spawn(self._run_job, key, message[2], message[3], message[4])
        elif kind == "cancel":
            stream = self.streams.get(key)
            if stream is None:
                self.cancelled.add(key)
            else:
                stream.cancel()
        elif kind == "status":
            self._reply(key, self.models.status())

    def _run_job(self, key: int, model: str, job: Any, spec: ConstraintSpec | None) -> None:
        try:
            stream = self.models.submit(model, job, spec)
        except ApiError as error:
            self._reply(key, rejection(error))
            return
        except Exception as exc:  # a bug: the worker answers 500 instead of waiting
            log.exception("engine host: submit failed")
            self._reply(key, rejection(ApiError("internal", f"engine host: {exc}")))
            return
        self.streams[key] = stream
        self._reply(key, None)
        if key in self.cancelled or not self._open:
            self.cancelled.discard(key)
            stream.cancel()
        try:
            for event in stream:
                if not isinstance(event, KeepAlive):  # the worker pings on its own
                    self._events.setdefault(key, []).append(event)
                    self._wake.set()
        finally:
            self.streams.pop(key, None)

    def _reply(self, key: int, value: Any) -> None:
        self._replies.append((key, value))
        self._wake.set()

    def _write_loop(self) -> None:
        """Send everything posted since the last frame. The engine's step events reach
        the job greenlets in one hub callback, and this greenlet runs after all of
        them, so one step makes one frame for this worker."""
        while self._open or self._replies or self._events:
            self._wake.wait()
            self._wake.clear()
            replies, self._replies = self._replies, []
            events, self._events = self._events, {}
            if not (replies or events):
                continue
            try:
                self.conn.send_bytes(encode_batch(replies, list(events.items())))
            except OSError:  # the worker went away; serve() cancels its jobs
                return


def serve(socket_path: Path, models: HostedModels, stop: gevent.event.Event, secret: str) -> None:
    if socket_path.exists():
        socket_path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(socket_path))
    os.chmod(socket_path, 0o600)
    listener.listen(64)
    handshakes = gevent.lock.BoundedSemaphore(MAX_HANDSHAKES)

    def handle(sock: socket.socket, address: Any) -> None:
        if not same_user(sock) or not handshakes.acquire(blocking=False):
            sock.close()
            return
        conn = Connection(sock, MAX_FRAME, "engine host wire", gevent.lock.Semaphore())
        try:
            host_handshake(conn, secret)
        except (OSError, ProtocolError) as exc:  # not a worker of this server
            log.warning("engine host: refused a connection without the server's secret (%s)", exc)
            conn.close()
            return
        finally:
            handshakes.release()
        WorkerConnection(conn, models).serve()

    server = StreamServer(listener, handle)
    server.start()
    log.info("engine host %d: serving on %s", os.getpid(), socket_path)
    stop.wait()
    server.stop(timeout=1)


def same_user(sock: socket.socket) -> bool:
    """Where the OS tells a Unix socket's peer (Linux), only this user's processes."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:  # the 0700 folder already keeps other users out
        return True
    import struct

    creds = sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i"))
    return bool(struct.unpack("3i", creds)[1] == os.getuid())


def watch(parent: int, stop: gevent.event.Event, models: HostedModels) -> None:
    """Stop when the master is gone; forget retired engines the fleet dropped."""
    while not stop.is_set():
        gevent.sleep(PARENT_POLL)
        if os.getppid() != parent:
            log.error("engine host: the gunicorn master is gone; stopping")
            stop.set()
        models.reap_gone()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--snapshot", type=Path, required=True)
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--log-format", default="human")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--only", help="a shard host: serve this sharded model alone")
    args = parser.parse_args(argv)
    from pipeserve.logs import logging_config

    logging.config.dictConfig(logging_config(args.log_format, args.log_level))
    args.secret = read_secret()
    if args.secret is None:
        log.error("engine host: no secret on stdin (the master hands it over); stopping")
        return 1
    stop = gevent.event.Event()
    models = HostedModels()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    gevent.signal_handler(signal.SIGUSR1, stop.set)
    if args.only:
        return serve_sharded(args, models, stop)
    gevent.signal_handler(
        signal.SIGHUP, lambda: gevent.spawn(reload, models, args.snapshot, args.secret)
    )
    log.info("engine host %d: loading models", os.getpid())
    try:
        models.apply(read_snapshot(args.snapshot, args.secret))
    except Exception:
        log.exception("engine host: loading the models failed")
        return 1
    models.fleet.start_reaper()  # keep_alive of the models loaded on demand
    gevent.spawn(watch, args.parent, stop, models)
    activity = ChatActivityWriter(activity_path(args.socket))
    gevent.spawn(publish_forever, activity, models.active_sequences, stop.is_set)
    serve(args.socket, models, stop, args.secret)
    log.info("engine host %d: stopping", os.getpid())
    models.fleet.close()
    return 0


def serve_sharded(args: argparse.Namespace, models: HostedModels, stop: gevent.event.Event) -> int:
    """A shard host: answer at once, place the model in the background (see the top)."""
    from pipeserve.engine.sharding import engine as sharded

    sharded.exit_process = exit_now  # a lost group: the master starts a fresh host
    gevent.signal_handler(signal.SIGHUP, lambda: log.info(
        "shard host: a sharded model's config changes apply when pipeserve restarts"))  # fmt: skip
    try:
        loaded = read_snapshot(args.snapshot, args.secret, only=args.only)
    except Exception:
        log.exception("shard host: reading the config failed")
        return 1
    key = model_key(loaded.config.models[0])
    models.placing[key] = f"model {args.only} is unavailable: it is being placed on its machines"
    gevent.spawn(place_until_served, models, loaded, key, stop)
    models.fleet.start_reaper()  # keep_alive of a model loaded on demand
    gevent.spawn(leave_when_spent, models, key, stop)
    gevent.spawn(watch, args.parent, stop, models)
    serve(args.socket, models, stop, args.secret)
    log.info("shard host %d: stopping", os.getpid())
    models.fleet.close()
    from pipeserve.engine.sharding.group import abandon_starting_groups

    abandon_starting_groups()
    return 0


def place_until_served(
    models: HostedModels, loaded: LoadedConfig, key: str, stop: gevent.event.Event
) -> None:
    """Load (place) the sharded model, retrying with backoff while it cannot be placed; a
    failure after its ranks joined a group ends the process (the master starts another).
    A retry first asks the machines (placeable): while too few answer, no engine is built."""
    from pipeserve.engine.sharding.group import group_joined

    entry = loaded.config.models[0]
    wait = PLACE_RETRY_FIRST
    reason = ""
    while not stop.is_set():
        try:
            if reason:
                run_off_hub(partial(placeable, entry))
            models.apply(loaded)
        except Exception as exc:
            if group_joined():
                log.error("shard host: model %s lost its group while starting; restarting",
                          entry.name)  # fmt: skip
                exit_now()
            reason = str(root_cause(exc))
            text = f"model {entry.name} is unavailable: {reason}; next try in {wait:.0f} s"
            models.placing[key] = text
            log.warning("%s", text)
            stop.wait(wait)
            wait = min(PLACE_RETRY_MAX, wait * 2)
            continue
        models.placing.pop(key, None)
        return


def root_cause(exc: BaseException) -> BaseException:
    """The innermost error (a load failure wraps the placement's own reason twice)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def placeable(entry: Any) -> None:
    """Raise PlacementError while the model's machines cannot hold it (hosts file only)."""
    sharding = entry.options.sharding
    if sharding is None or not sharding.hostfile:
        return
    from pipeserve.engine.sharding.group import SSH_OPTIONS
    from pipeserve.engine.sharding.placement import place
    from pipeserve.engine.weights.loader import resolve_source

    place(sharding, resolve_source(entry.source, entry.sha256), SSH_OPTIONS, quiet=True)


def leave_when_spent(models: HostedModels, key: str, stop: gevent.event.Event) -> None:
    """A process joins one mx.distributed group, ever: once the sharded model is unloaded
    after joining one (keep_alive of `load: on_demand`, or a load that failed after the
    ranks joined), this host exits and the master starts a fresh one, which places the
    model again at its next load."""
    from pipeserve.engine.sharding.group import group_joined

    while not stop.is_set():
        stop.wait(SPENT_POLL)
        runtime = models.runtimes.get(key)
        if runtime is None or stop.is_set():
            continue
        if managed(runtime).state == "unloaded" and group_joined():
            log.info("shard host: model %s was unloaded; a fresh host takes over", runtime.name)
            exit_now()


def exit_now() -> None:
    """Leave at once (a sharded model's engine thread may be stuck in a collective, so no
    orderly close); the workers fail what is left in flight and the master restarts us."""
    logging.shutdown()
    os._exit(3)


def read_secret() -> str | None:
    """The server's secret, the one line the master writes to our stdin."""
    line = sys.stdin.readline(256).strip()
    if len(line) != 2 * SECRET_BYTES or any(c not in "0123456789abcdef" for c in line):
        return None
    return line


def read_snapshot(path: Path, secret: str, only: str | None = None) -> LoadedConfig:
    """The master's config (its MAC checked before it is unpickled); `only`: that model
    alone, else every model but the sharded ones (each runs in a shard host of its own)."""
    loaded: LoadedConfig = read_sealed(path, secret)
    models = [
        e for e in loaded.config.models if (e.name == only if only else e.options.sharding is None)
    ]
    if only and not models:
        raise ValueError(f"model {only} is not in the config")
    return replace(loaded, config=loaded.config.model_copy(update={"models": models}))


def reload(models: HostedModels, snapshot: Path, secret: str) -> None:
    try:
        models.apply(read_snapshot(snapshot, secret))
        log.info("engine host: reloaded the config")
    except Exception:
        log.exception("engine host: reload failed; the previous models keep serving")


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    os._exit(code)  # engine threads are parked daemons (engine/mlx/engine.py _park)
