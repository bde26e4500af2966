"""Rank 0's side of a sharded model's group: start the other ranks, join mx.distributed,
watch the ranks, and tear the group down by PID.

Ranks 1..N-1 are `python -m pipeserve.engine.sharding.peer` processes: local children
(posix_spawn; they die with this process through PR_SET_PDEATHSIG and the control
channel's EOF) or, from an mlx hosts file, started over `ssh -tt` as mlx.launch does.
mx.distributed has no timeouts, so a watchdog thread on rank 0 declares the group lost
when a rank's process ends, one engine step outlasts `step_timeout`, or a rank's control
connection stops acknowledging the pings the watchdog sends every second (a cut link,
found within KEEPALIVE s even while idle); it then kills every other rank (which makes a
collective blocked on a dead or stopped peer raise on the engine thread) and calls
`on_lost`. A lost group is never reused: the ring cannot be re-initialised in the same
process, so the process that holds rank 0 exits and its supervisor starts a fresh one,
which places the model again (placement.py). The other ranks watch rank 0 too (peer.py):
without a message from it for too long they exit by themselves.

Ranks are started in a session of their own, so that a Ctrl-C or a service manager's
SIGTERM to pipeserve's process group does not reach them (or their ssh clients) before
rank 0 closes the group in order.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from socket import SO_REUSEADDR, SOL_SOCKET
from typing import Any

from pipeserve.child_env import child_environment
from pipeserve.config.models import EngineOptions, ShardingOptions
from pipeserve.engine.sharding.control import (
    REPORT_FRAME,
    ChannelClosed,
    Connection,
)
from pipeserve.engine.sharding.frames import HELLO_MAX, Handshake, ProtocolError, parse_hello
from pipeserve.engine.sharding.placement import Placement, place
from pipeserve.engine.sharding.procs import reap, spawn
from pipeserve.errors import LoadRefused
from pipeserve.gevent_support import os_lock, os_sleep, os_socket_class, start_os_thread

log = logging.getLogger("pipeserve.sharding")

WATCH_INTERVAL = 0.1
PING_INTERVAL = 1.0
KEEPALIVE = 8.0  # seconds a rank's control connection may leave data unacknowledged
STOP_GRACE = 5.0
HELLO_TIMEOUT = 10.0  # seconds a connection has for its whole handshake
# Connections in their handshake at once; a newer one ends the oldest (a genuine rank
# finishes within one round trip, so a flood of silent connections cannot keep it out).
MAX_HANDSHAKES = 32
PEER_MODULE = "pipeserve.engine.sharding.peer"
# What a remote rank inherits from rank 0's environment (a local rank inherits it all):
# the BLAS preload (pipeserve.blas), MLX's and OpenBLAS's settings, pipeserve's home and
# log level; never secrets (API keys, the cluster token): ssh's command line is public.
# The group's settings and secret token go to every rank as one line on its stdin
# (`settings_line`), never on a command line or in an environment.
REMOTE_ENV_PREFIXES = ("MLX_", "OPENBLAS_", "OMP_")
REMOTE_ENV_NAMES = ("LD_PRELOAD", "LD_LIBRARY_PATH", "PIPESERVE_BLAS_APPLIED",
                    "PIPESERVE_HOME", "PIPESERVE_LOG_LEVEL")  # fmt: skip
SSH_OPTIONS = ["-o", "LogLevel=QUIET", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
               "-o", "ServerAliveInterval=2", "-o", "ServerAliveCountMax=3"]  # fmt: skip
REMOTE_KILL_TRIES = 8
_GROUP_JOINED = False  # this process entered mx.distributed.init: no other group, ever
_STARTED: list[RankGroup] = []  # every group this process started (few: one a placement)


def group_joined() -> bool:
    """Whether this process has joined an mx.distributed group (it cannot join another)."""
    return _GROUP_JOINED


class GroupLost(LoadRefused):
    """The group cannot go on (a rank died, hung or broke the protocol)."""


@dataclass
class Peer:
    rank: int
    pid: int  # the local process: the rank itself, or its ssh client
    ssh_host: str | None = None
    remote_pid: int | None = None
    conn: Connection | None = None
    stdin: int | None = None  # the write end of the rank's stdin: closing it ends the rank


class RankGroup:
    """Owns ranks 1..N-1 of one sharded model; rank 0 is the calling process."""

    def __init__(
        self, name: str, model_dir: Path, options: EngineOptions, on_lost: Callable[[str], None]
    ) -> None:
        assert options.sharding is not None
        self.name = name
        self.model_dir = model_dir
        self.options = options
        self.sharding: ShardingOptions = options.sharding
        self.on_lost = on_lost
        self.peers: list[Peer] = []
        self.healthy = False
        self.reason = "starting"
        self.step_started: float | None = None
        self._phase = "starting"
        self._in_init = False
        self._lost = False
        self._lock = os_lock()
        self._token = secrets.token_hex(16)
        self._ring_file: str | None = None
        self._listener: Any = None
        self._handshakes: list[Any] = []  # sockets in their handshake now, oldest first
        self._refused = 0  # control connections refused so far
        self._deadline = time.monotonic() + self.sharding.start_timeout
        _STARTED.append(self)

    # -- start ---------------------------------------------------------------------

    def start(self) -> Any:
        """Place the ranks (on the machines that answer), start them and join the group;
        returns the mx.distributed group. self.options is the placed model's options."""
        where, self.sharding = place_ranks(self.sharding, self.model_dir)
        self.options = self.options.model_copy(update={"sharding": self.sharding})
        self._listen(where.control_ip)
        self._write_ring(where.ring)
        for rank in range(1, len(where.ring)):
            self._spawn(rank, where)
        start_os_thread(self._watch, name=f"pipeserve-shard-watch-{self.name}")
        self._accept_all()
        return self._join(len(where.ring))

    def _join(self, size: int) -> Any:
        """Join the ring as rank 0 (every rank has said hello): the mx.distributed group."""
        global _GROUP_JOINED
        import mlx.core as mx

        os.environ["MLX_RANK"] = "0"
        os.environ["MLX_HOSTFILE"] = self._ring_file or ""
        self._in_init = True  # blocks for good if a rank dies before joining the ring
        _GROUP_JOINED = True
        group = mx.distributed.init(strict=True, backend=self.sharding.backend)
        self._in_init = False
        if group.size() != size:
            raise GroupLost(f"mx.distributed gave a group of {group.size()} ranks")
        return group

    def _listen(self, ip: str) -> None:
        sock = os_socket_class()()
        sock.setsockopt(SOL_SOCKET, SO_REUSEADDR, 1)
        sock.bind((ip, 0))
        sock.listen(64)
        self._listener = sock
        self._control = f"{ip}:{sock.getsockname()[1]}"

    def _write_ring(self, ring: list[list[str]]) -> None:
        fd, path = tempfile.mkstemp(prefix="pipeserve-ring-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(ring, f)
        self._ring_file = path

    def _settings(self, ring: list[list[str]]) -> dict[str, str]:
        """What a rank reads from its stdin (peer.py): the token and the group's settings."""
        return {
            "PIPESERVE_SHARD_RING": json.dumps(ring),
            "PIPESERVE_SHARD_CONTROL": self._control,
            "PIPESERVE_SHARD_TOKEN": self._token,
            "PIPESERVE_SHARD_MODEL_DIR": str(self.model_dir),
            "PIPESERVE_SHARD_OPTIONS": self.options.model_dump_json(),
            "PIPESERVE_SHARD_NAME": self.name,
        }

    def _spawn(self, rank: int, place: Placement) -> Peer:
        if self._phase != "starting":  # stopped (the shard host is leaving) or lost
            raise GroupLost(self.reason if self._phase == "lost" else "the group was stopped")
        labels = [f"--model={self.name}", f"--rank={rank}", "--settings=stdin"]
        host = place.ssh_hosts[rank]
        read_end, write_end = os.pipe()
        try:
            if host is None:
                env = child_environment(
                    {"MLX_RANK": str(rank), "PIPESERVE_SHARD_PARENT": str(os.getpid()),
                     "MLX_HOSTFILE": self._ring_file or ""}
                )  # fmt: skip
                argv = [sys.executable, "-m", PEER_MODULE, *labels]
                pid = spawn(sys.executable, argv, env, stdin=read_end)
            else:
                pid = self._spawn_ssh(host, {**remote_environment(), "MLX_RANK": str(rank)},
                                      labels, read_end)  # fmt: skip
        finally:
            os.close(read_end)
        peer = Peer(rank, pid, host, stdin=write_end)
        self.peers.append(peer)
        try:
            os.write(write_end, settings_line(self._settings(place.ring)))
        except OSError:  # the rank has already exited: the watch reports it
            pass
        log.info("model %s: rank %d started, pid %d%s", self.name, rank, pid,
                 f" (ssh {host})" if host else "")  # fmt: skip
        return peer

    def _spawn_ssh(self, host: str, extra: dict[str, str], labels: list[str], stdin: int) -> int:
        """As mlx.launch: same Python and working folder on the remote host; no terminal
        (it would echo the settings line), so the rank ends at its stdin's end instead."""
        ssh = shutil.which("ssh")
        if ssh is None:
            raise GroupLost("ssh is not installed: remote ranks are started over ssh")
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in extra.items())
        python = shlex.quote(sys.executable)
        command = f"cd {shlex.quote(os.getcwd())} && exec env {env} {python} -m {PEER_MODULE} {shlex.join(labels)}"
        argv = [ssh, "-T", *SSH_OPTIONS, host, command]
        return spawn(ssh, argv, child_environment(), stdin=stdin)

    def _accept_all(self) -> None:
        """Each rank connects and proves it holds the group's token (frames.Handshake)
        before joining the ring. Connections shake hands on threads of their own, each
        within HELLO_TIMEOUT, so none (slow, silent or malformed) holds up another; a
        group lost meanwhile ends the wait within a second."""
        while True:
            with self._lock:
                waiting = sorted(p.rank for p in self.peers if p.conn is None)
            if not waiting:
                return
            left = self._deadline - time.monotonic()
            if self._phase == "lost":
                raise GroupLost(self.reason)
            if self._phase == "stopped":
                raise GroupLost("the group was stopped")
            if left <= 0:
                raise GroupLost(f"ranks {waiting} did not join within start_timeout")
            self._listener.settimeout(min(left, 1.0))
            try:
                # _accept: the socket module's accept() would wrap the new connection in
                # gevent's socket class; keep it a plain OS socket like the listener.
                fd, _ = self._listener._accept()
            except (TimeoutError, OSError):
                continue
            sock = os_socket_class()(fileno=fd)
            with self._lock:
                oldest = (
                    self._handshakes.pop(0) if len(self._handshakes) >= MAX_HANDSHAKES else None
                )
                self._handshakes.append(sock)
            if oldest is not None:
                _shut(oldest)  # its thread's read ends now
            start_os_thread(partial(self._shake_hands, sock), name="pipeserve-shard-hello")

    def _shake_hands(self, sock: Any) -> None:
        """One connection's handshake; on success it becomes its rank's connection."""
        conn = Connection(sock, max_frame=REPORT_FRAME)
        try:
            joined = self._handshake(conn)
        except (ChannelClosed, TimeoutError, ProtocolError, OSError) as exc:
            self._refused += 1  # the first is a warning; a flood of them is not a log flood
            level = logging.WARNING if self._refused == 1 else logging.DEBUG
            log.log(level, "model %s: a control connection was refused: %s", self.name, exc)
            joined = None
        finally:
            with self._lock:
                if sock in self._handshakes:
                    self._handshakes.remove(sock)
        if joined is None:
            conn.close()

    def _handshake(self, conn: Connection) -> Peer | None:
        deadline = min(time.monotonic() + HELLO_TIMEOUT, self._deadline)
        rank, pid, nonce = parse_hello(conn.recv_json(_left(deadline), HELLO_MAX))
        with self._lock:
            peer = next((p for p in self.peers if p.rank == rank and p.conn is None), None)
        if peer is None:
            return None
        shake = Handshake(self._token, rank)
        conn.send_json(shake.challenge(nonce))
        shake.check_rank(conn.recv_json(_left(deadline), HELLO_MAX))
        conn.session = shake.session(is_rank0=True)
        with self._lock:
            if peer.conn is not None:  # another connection proved itself first
                return None
            peer.conn, peer.remote_pid = conn, pid or None
        _keepalive(conn.sock)
        return peer

    def wait_ready(self) -> list[dict[str, Any]]:
        """Every other rank's report once it has loaded its share (or its load error)."""
        reports = []
        for peer in self.peers:
            assert peer.conn is not None
            left = max(0.1, self._deadline - time.monotonic())
            try:
                report = peer.conn.recv_json(timeout=left)
            except TimeoutError as exc:
                raise GroupLost(f"rank {peer.rank} did not load within start_timeout") from exc
            except ChannelClosed as exc:
                raise GroupLost(f"rank {peer.rank} exited while loading") from exc
            if "error" in report:
                raise GroupLost(f"rank {peer.rank} failed to load: {report['error']}")
            reports.append(report)
        return reports

    def begin(self) -> int:
        """The group is up: send every rank the shared random seed; returns it."""
        seed = random.getrandbits(32)
        for peer in self.peers:  # from now on a send that cannot finish is a lost rank
            assert peer.conn is not None
            peer.conn.sock.settimeout(self.sharding.step_timeout)
        self.broadcast(("start", seed))
        self._phase = "running"
        self.healthy = True
        self.reason = ""
        return seed

    # -- running -------------------------------------------------------------------

    def broadcast(self, message: Any) -> None:
        for peer in self.peers:
            if peer.conn is None:
                raise GroupLost(f"rank {peer.rank} is not connected")
            try:
                peer.conn.send_obj(message)
            except ChannelClosed as exc:
                raise GroupLost(f"rank {peer.rank}: {exc}") from exc

    def pids(self) -> list[int]:
        return [p.pid for p in self.peers]

    def _watch(self) -> None:
        next_ping = time.monotonic()
        while self._phase in ("starting", "running"):
            os_sleep(WATCH_INTERVAL)
            problem = self._problem()
            if problem is None and self._phase == "running" and time.monotonic() >= next_ping:
                next_ping = time.monotonic() + PING_INTERVAL
                problem = self._ping()
            if problem:
                self.lose(problem)
        self._reap()

    def _ping(self) -> str | None:
        """Keep every rank's control connection busy: a cut link shows up as a send error
        once KEEPALIVE seconds of data go unacknowledged, even while nothing is decoded."""
        for peer in self.peers:
            if peer.conn is None:
                continue
            try:
                peer.conn.send_obj(("ping",))
            except ChannelClosed as exc:
                where = f" on {peer.ssh_host}" if peer.ssh_host else ""
                return f"rank {peer.rank}{where} is unreachable ({exc})"
        return None

    def _problem(self) -> str | None:
        for peer in self.peers:
            if not _alive(peer.pid):
                return f"rank {peer.rank} (pid {peer.pid}) exited"
        started = self.step_started
        timeout = self.sharding.step_timeout
        if started is not None and time.monotonic() - started > timeout:
            return f"an engine step took more than step_timeout ({timeout:g} s): a rank hangs"
        if self._phase == "starting" and time.monotonic() > self._deadline + 5.0:
            return "the group did not start within start_timeout"
        return None

    def lose(self, reason: str) -> None:
        """The group is broken: unhealthy from now on, every other rank killed, on_lost."""
        with self._lock:
            if self._phase in ("lost", "stopped"):
                return
            starting = self._phase == "starting"
            self._phase = "lost"
            self._lost = True
        self.healthy = False
        self.reason = reason
        log.error("model %s: shard group lost: %s", self.name, reason)
        self._kill_all()
        if starting and self._in_init:
            # rank 0 is blocked in mx.distributed.init (accept) for good: no way back.
            log.error("model %s: the group never started; exiting", self.name)
            os._exit(3)
        if not starting:
            self.on_lost(reason)

    # -- stop ----------------------------------------------------------------------

    def stop(self) -> None:
        """Close: ask every rank to exit, then kill what is left by PID."""
        with self._lock:
            was = self._phase
            self._phase = "stopped"
        if was == "running":
            try:
                self.broadcast(("close",))
            except GroupLost:
                pass
        deadline = time.monotonic() + STOP_GRACE
        while time.monotonic() < deadline and any(_alive(p.pid) for p in self.peers):
            os_sleep(0.05)
        self._kill_all()
        self._reap()
        for peer in self.peers:
            if peer.conn is not None:
                peer.conn.close()
            _close_stdin(peer)
        if self._listener is not None:
            self._listener.close()
        if self._ring_file:
            Path(self._ring_file).unlink(missing_ok=True)

    def abandon(self) -> None:
        """A group still starting when its process leaves: kill what it started, on every
        machine, at once (no close: the ranks may not be listening yet)."""
        with self._lock:
            if self._phase != "starting":
                return
            self._phase = "stopped"
            self._lost = True  # remote ranks are killed over ssh too
        if not self.peers:  # registered, never started a rank: nothing to stop or say
            return
        log.info("model %s: stopping a placement in progress", self.name)
        self._kill_all()
        for peer in self.peers:
            _close_stdin(peer)

    def _kill_all(self) -> None:
        """SIGKILL every other rank; remote ones over ssh too, when the group was lost or
        their ssh session is still open (a rank that closed normally ends its session)."""
        for peer in self.peers:
            if peer.ssh_host and peer.remote_pid and (self._lost or _alive(peer.pid)):
                _kill_remote(peer.ssh_host, peer.remote_pid)
            try:
                os.kill(peer.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _reap(self) -> None:
        for peer in self.peers:
            _waitpid(peer.pid)


def abandon_starting_groups() -> None:
    """Before this process exits: no rank of a placement in progress may outlive it."""
    for group in list(_STARTED):
        group.abandon()


def _shut(sock: Any) -> None:
    import socket

    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the handshake did not finish in time")
    return left


def settings_line(settings: dict[str, str]) -> bytes:
    return json.dumps(settings).encode() + b"\n"


def _close_stdin(peer: Peer) -> None:
    if peer.stdin is not None:
        fd, peer.stdin = peer.stdin, None
        try:
            os.close(fd)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    """Running (or stopped), not gone and not a zombie; reaps a zombie child."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    if state == b"Z":
        _waitpid(pid)
        return False
    return True


def _waitpid(pid: int) -> None:
    reap(pid)


def _kill_remote(host: str, pid: int) -> None:
    """SIGKILL a remote rank, retrying for a while from a detached shell (the host may be
    unreachable now, and this process may exit before it is back). The rank also exits by
    itself once rank 0 has been silent for too long (peer.py)."""
    ssh = shutil.which("ssh")
    if ssh is None:
        return
    once = shlex.join([ssh, *SSH_OPTIONS, host, f"kill -9 {pid} 2>/dev/null; true"])
    script = f"for i in $(seq {REMOTE_KILL_TRIES}); do {once} && exit 0; sleep 3; done"
    spawn("/bin/sh", ["/bin/sh", "-c", script], child_environment())


def remote_environment() -> dict[str, str]:
    """What a remote rank gets of rank 0's environment, as a local rank would."""
    return {k: v for k, v in os.environ.items()
            if k.startswith(REMOTE_ENV_PREFIXES) or k in REMOTE_ENV_NAMES}  # fmt: skip


def _keepalive(sock: Any) -> None:
    """Unacknowledged data for KEEPALIVE seconds breaks the connection (Linux)."""
    import socket

    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    if option is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, option, int(KEEPALIVE * 1000))
    sock.settimeout(None)


def place_ranks(options: ShardingOptions, model_dir: Path) -> tuple[Placement, ShardingOptions]:
    return place(options, model_dir, SSH_OPTIONS)
