"""Rank 0's side of a sharded model's group: start the other ranks, join mx.distributed,
watch the ranks, and tear the group down by PID.

Ranks 1..N-1 are `python -m pipeserve.engine.sharding.peer` processes: local children
(posix_spawn; they die with this process through PR_SET_PDEATHSIG and the control
channel's EOF) or, from an mlx hosts file, started over `ssh -tt` as mlx.launch does.
mx.distributed has no timeouts, so a watchdog thread on rank 0 declares the group lost
when a rank's process ends or one engine step outlasts `step_timeout`; it then kills
every other rank (which makes a collective blocked on a dead or stopped peer raise on
the engine thread) and calls `on_lost`. A lost group is never reused: the ring cannot be
re-initialised in the same process, so the worker exits and gunicorn starts a new one.
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
from pathlib import Path
from socket import SO_REUSEADDR, SOL_SOCKET
from typing import Any

from pipeserve.config.models import EngineOptions, ShardingOptions
from pipeserve.engine.channel import os_lock, start_os_thread
from pipeserve.engine.sharding.control import ChannelClosed, Connection, os_sleep, os_socket_class

log = logging.getLogger("pipeserve.sharding")

WATCH_INTERVAL = 0.1
STOP_GRACE = 5.0
PEER_MODULE = "pipeserve.engine.sharding.peer"


class GroupLost(RuntimeError):
    """The group cannot go on (a rank died, hung or broke the protocol)."""


@dataclass
class Peer:
    rank: int
    pid: int  # the local process: the rank itself, or its ssh client
    ssh_host: str | None = None
    remote_pid: int | None = None
    conn: Connection | None = None


@dataclass(frozen=True)
class Placement:
    """Where each rank runs: ssh host (None: this machine) and its ring address."""

    ssh_hosts: list[str | None]
    ring: list[list[str]]  # mx.distributed ring hostfile: per rank, its "ip:port"s
    control_ip: str  # where rank 0 listens for the other ranks


def placement(options: ShardingOptions) -> Placement:
    if options.hostfile:
        from pipeserve.engine.sharding.hostfile import read_hostfile

        hosts, problem = read_hostfile(Path(options.hostfile))
        if problem:
            raise ValueError(problem)
        first = options.port or 32323
        ssh = [None] + [str(h["ssh"]) for h in hosts[1:]]
        ring = [[f"{h['ips'][0]}:{first + r}"] for r, h in enumerate(hosts)]
        return Placement(ssh, ring, str(hosts[0]["ips"][0]))
    size = options.size
    ports = [options.port + r for r in range(size)] if options.port else _free_ports(size)
    return Placement([None] * size, [[f"127.0.0.1:{p}"] for p in ports], "127.0.0.1")


def _free_ports(count: int) -> list[int]:
    socks, ports = [], []
    for _ in range(count):
        sock = os_socket_class()()
        sock.bind(("127.0.0.1", 0))
        socks.append(sock)
        ports.append(sock.getsockname()[1])
    for sock in socks:
        sock.close()
    return ports


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
        self._lock = os_lock()
        self._token = secrets.token_hex(16)
        self._ring_file: str | None = None
        self._listener: Any = None
        self._deadline = time.monotonic() + self.sharding.start_timeout

    # -- start ---------------------------------------------------------------------

    def start(self) -> Any:
        """Start the other ranks and join the group; returns the mx.distributed group."""
        import mlx.core as mx

        place = placement(self.sharding)
        self._listen(place.control_ip)
        self._write_ring(place.ring)
        for rank in range(1, len(place.ring)):
            self.peers.append(self._spawn(rank, place))
        start_os_thread(self._watch, name=f"pipeserve-shard-watch-{self.name}")
        self._accept_all()
        os.environ["MLX_RANK"] = "0"
        os.environ["MLX_HOSTFILE"] = self._ring_file or ""
        self._in_init = True  # blocks for good if a rank dies before joining the ring
        group = mx.distributed.init(strict=True, backend=self.sharding.backend)
        self._in_init = False
        if group.size() != len(place.ring):
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

    def _peer_env(self, rank: int, ring: list[list[str]]) -> dict[str, str]:
        return {
            "MLX_RANK": str(rank),
            "PIPESERVE_SHARD_RING": json.dumps(ring),
            "PIPESERVE_SHARD_CONTROL": self._control,
            "PIPESERVE_SHARD_TOKEN": self._token,
            "PIPESERVE_SHARD_MODEL_DIR": str(self.model_dir),
            "PIPESERVE_SHARD_OPTIONS": self.options.model_dump_json(),
            "PIPESERVE_SHARD_NAME": self.name,
        }

    def _spawn(self, rank: int, place: Placement) -> Peer:
        extra = self._peer_env(rank, place.ring)
        host = place.ssh_hosts[rank]
        if host is None:
            env = {**os.environ, **extra, "PIPESERVE_SHARD_PARENT": str(os.getpid())}
            env["MLX_HOSTFILE"] = self._ring_file or ""
            argv = [sys.executable, "-m", PEER_MODULE, f"--model={self.name}", f"--rank={rank}"]
            pid = _posix_spawn(sys.executable, argv, env)
        else:
            pid = self._spawn_ssh(host, extra)
        log.info("model %s: rank %d started, pid %d%s", self.name, rank, pid,
                 f" (ssh {host})" if host else "")  # fmt: skip
        return Peer(rank, pid, host)

    def _spawn_ssh(self, host: str, extra: dict[str, str]) -> int:
        """As mlx.launch: same Python and working folder on the remote host."""
        ssh = shutil.which("ssh")
        if ssh is None:
            raise GroupLost("ssh is not installed: remote ranks are started over ssh")
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in extra.items())
        command = f"cd {shlex.quote(os.getcwd())} && exec env {env} {shlex.quote(sys.executable)} -m {PEER_MODULE}"
        argv = [ssh, "-tt", "-o", "LogLevel=QUIET", host, command]
        return _posix_spawn(ssh, argv, dict(os.environ))

    def _accept_all(self) -> None:
        """Each rank connects and says hello (rank, pid, token) before joining the ring."""
        waiting = {p.rank: p for p in self.peers}
        while waiting:
            left = self._deadline - time.monotonic()
            if self._phase == "lost":
                raise GroupLost(self.reason)
            if left <= 0:
                raise GroupLost(f"ranks {sorted(waiting)} did not join within start_timeout")
            self._listener.settimeout(min(left, 1.0))
            try:
                # _accept: the socket module's accept() would wrap the new connection in
                # gevent's socket class; keep it a plain OS socket like the listener.
                fd, _ = self._listener._accept()
            except TimeoutError:
                continue
            sock = os_socket_class()(fileno=fd)
            conn = Connection(sock)
            try:
                hello = conn.recv_json(timeout=10.0)
            except (ChannelClosed, TimeoutError, ValueError):
                conn.close()
                continue
            peer = waiting.get(int(hello.get("rank", -1)))
            if peer is None or hello.get("token") != self._token:
                conn.close()
                continue
            peer.conn, peer.remote_pid = conn, int(hello.get("pid", 0)) or None
            sock.settimeout(None)
            del waiting[peer.rank]

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
        while self._phase in ("starting", "running"):
            os_sleep(WATCH_INTERVAL)
            problem = self._problem()
            if problem:
                self.lose(problem)
        self._reap()

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
        if self._listener is not None:
            self._listener.close()
        if self._ring_file:
            Path(self._ring_file).unlink(missing_ok=True)

    def _kill_all(self) -> None:
        for peer in self.peers:
            if peer.ssh_host and peer.remote_pid:
                _kill_remote(peer.ssh_host, peer.remote_pid)
            try:
                os.kill(peer.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _reap(self) -> None:
        for peer in self.peers:
            _waitpid(peer.pid)


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


def _unpatched_os(name: str) -> Any:
    """os.<name> as the OS has it: gevent's versions need the hub of the main thread."""
    if "gevent.monkey" in sys.modules:
        from gevent import monkey

        return monkey.get_original("os", name)
    return getattr(os, name)


def _posix_spawn(path: str, argv: list[str], env: dict[str, str]) -> int:
    return int(_unpatched_os("posix_spawn")(path, argv, env))


def _waitpid(pid: int) -> None:
    try:
        _unpatched_os("waitpid")(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _kill_remote(host: str, pid: int) -> None:
    ssh = shutil.which("ssh")
    if ssh:
        _posix_spawn(ssh, [ssh, "-o", "LogLevel=QUIET", host, f"kill -9 {pid}"], dict(os.environ))
