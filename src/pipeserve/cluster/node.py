"""`pipeserve node`: the agent that lets a machine hold ranks of a sharded model.

It answers a small HTTP API. Every request must be signed with the cluster token and
every answer is signed in turn (auth.py: HMAC, the token never travels); anything else
is a 401, unsigned:

    GET    /v1/node             this machine's report (memory, MLX, versions) and a free port
    POST   /v1/node/ranks       an assignment: fetch the model files, start the rank
    GET    /v1/node/ranks/{id}  the rank's state; each call is the serving machine's heartbeat
    DELETE /v1/node/ranks/{id}  stop the rank

An assignment is data, never a command: the agent itself starts pipeserve's own rank
entry point (`python -m pipeserve.engine.sharding.peer`, the one local and ssh ranks
run) with the assignment's validated settings. A rank stops when told, when its rank 0
closes the group, when the serving machine's heartbeats stop for `heartbeat_timeout`
seconds, or when this agent exits (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeserve.child_env import child_environment
from pipeserve.cluster.auth import (
    RequestVerifier,
    endpoint,
    group_secret,
    sign_response,
)
from pipeserve.cluster.files import ModelFile, fetch_model, folder_key
from pipeserve.cluster.limits import ConnectionLimits
from pipeserve.cluster.report import machine_report
from pipeserve.config.models import EngineOptions

log = logging.getLogger("pipeserve.cluster")

PEER_MODULE = "pipeserve.engine.sharding.peer"
ADDRESS = r"^[0-9A-Za-z.:\[\]-]+:[0-9]{1,5}$"
IP = r"^[0-9A-Fa-f.:]{2,45}$"
MAX_BODY = 1 << 20  # an assignment's bytes; GET and DELETE carry none
# Seconds a connection may stay silent: without a limit every idle connection from
# anyone on the LAN (no token needed to connect) holds one of the agent's threads forever.
IDLE_TIMEOUT = 30.0
# Before a request is authenticated, nobody may hold more than this (limits.py): one
# request per connection (HTTP/1.0), answered within CONNECTION_DEADLINE seconds in all.
MAX_CONNECTIONS = 64
MAX_PER_ADDRESS = 16
CONNECTION_DEADLINE = 10.0
STOP_GRACE = 3.0
REAP_INTERVAL = 0.5


class Assignment(BaseModel):
    """What the serving machine asks of this node: validated, then used as data only."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(pattern=r"^[A-Za-z0-9_.:/-]{1,200}$")
    rank: int = Field(ge=1, le=63)
    ring: list[list[str]] = Field(min_length=2, max_length=64)
    control: str = Field(pattern=ADDRESS)
    group_nonce: str = Field(pattern=r"^[0-9a-f]{32}$")  # the group's secret: group_secret()
    options: EngineOptions
    files: list[ModelFile] = Field(min_length=1)
    # Where the model files are fetched from: inside the signed assignment, never the
    # address the request came from (a relay's).
    files_host: str = Field(pattern=IP)
    files_port: int = Field(ge=1, le=65535)
    layers: tuple[int, int] | None = None
    heartbeat_timeout: float = Field(15.0, gt=0, le=3600)


@dataclass
class RankJob:
    id: str
    assignment: Assignment
    source_ip: str
    state: str = "fetching"  # fetching, running, exited, failed, stopped
    detail: str = ""
    process: subprocess.Popen[bytes] | None = None
    last_seen: float = field(default_factory=time.monotonic)
    files: dict[str, Any] = field(default_factory=dict)

    def view(self) -> dict[str, Any]:
        code = self.process.poll() if self.process else None
        return {
            "id": self.id,
            "model": self.assignment.model,
            "rank": self.assignment.rank,
            "state": self.state,
            "detail": self.detail,
            "pid": self.process.pid if self.process else None,
            "exit_code": code,
            "files": self.files,
        }


class NodeAgent:
    def __init__(self, token: str, cluster: str, memory: int | None, models: Path) -> None:
        self.token = token
        self.verifier = RequestVerifier(token)
        self.cluster = cluster
        self.memory = memory
        self.models = models
        self.node_id = node_id(models)
        self.jobs: dict[str, RankJob] = {}
        self.lock = threading.Lock()
        self.closing = False

    # -- the API ----------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        with self.lock:
            ranks = [job.view() for job in self.jobs.values()]
        return {
            "cluster": self.cluster,
            "node_id": self.node_id,
            **machine_report(self.memory),
            "ring_port": free_port(),
            "ranks": ranks,
        }

    def assign(self, assignment: Assignment, source_ip: str) -> RankJob:
        job = RankJob(secrets.token_hex(8), assignment, source_ip)
        with self.lock:
            self.jobs[job.id] = job
        log.info("assignment %s: model %s rank %d from %s", job.id, assignment.model,
                 assignment.rank, source_ip)  # fmt: skip
        threading.Thread(target=self._prepare_and_start, args=(job,), daemon=True).start()
        return job

    def heartbeat(self, job_id: str) -> RankJob | None:
        with self.lock:
            job = self.jobs.get(job_id)
        if job is not None:
            job.last_seen = time.monotonic()
            self._refresh(job)
        return job

    def stop(self, job_id: str, why: str) -> RankJob | None:
        with self.lock:
            job = self.jobs.get(job_id)
        if job is not None:
            self._stop_job(job, why, wait=False)
        return job

    # -- ranks ------------------------------------------------------------------------

    def _prepare_and_start(self, job: RankJob) -> None:
        assignment = job.assignment
        folder = self.models / folder_key(assignment.files)
        try:
            fetched = fetch_model(
                folder,
                assignment.files,
                assignment.layers,
                (assignment.files_host, assignment.files_port),
                self.token,
            )
        except (OSError, ValueError, RuntimeError) as exc:
            job.state, job.detail = "failed", f"fetching the model files: {exc}"
            log.error("assignment %s: %s", job.id, job.detail)
            return
        job.files = {"fetched": fetched.fetched, "reused": fetched.reused,
                     "fetched_bytes": fetched.fetched_bytes, "sha256_checked": True}  # fmt: skip
        log.info("assignment %s: model files in %s (fetched %s, reused %s)", job.id, folder,
                 fetched.fetched or "none", fetched.reused or "none")  # fmt: skip
        with self.lock:
            if job.state != "fetching":  # stopped while fetching
                return
            argv = [sys.executable, "-m", PEER_MODULE, f"--model={assignment.model}",
                    f"--rank={assignment.rank}", "--settings=stdin"]  # fmt: skip
            try:
                job.process = subprocess.Popen(argv, env=self._rank_env(assignment),
                                               stdin=subprocess.PIPE)  # fmt: skip
            except OSError as exc:
                job.state, job.detail = "failed", f"starting the rank: {exc}"
                return
            send_settings(job.process, rank_settings(assignment, folder, self.token))
            job.state = "running"
        log.info("assignment %s: rank %d started, pid %d", job.id, assignment.rank, job.process.pid)

    def _rank_env(self, assignment: Assignment) -> dict[str, str]:
        env = child_environment()  # never the cluster token (nor the API keys)
        env.pop("MLX_HOSTFILE", None)
        env.update(MLX_RANK=str(assignment.rank), PIPESERVE_SHARD_PARENT=str(os.getpid()))
        return env

    def _refresh(self, job: RankJob) -> None:
        if job.state == "running" and job.process is not None:
            code = job.process.poll()
            if code is not None:
                if job.process.stdin is not None:
                    job.process.stdin.close()
                job.state, job.detail = "exited", f"exit code {code}"
                log.info("assignment %s: rank %d exited (%d)", job.id, job.assignment.rank, code)

    def _stop_job(self, job: RankJob, why: str, wait: bool = True) -> None:
        """Mark the job stopped and SIGTERM its rank (SIGKILL after STOP_GRACE); with
        `wait` False (an API call) the grace runs on a thread of its own, so the answer
        comes at once rather than after up to STOP_GRACE seconds."""
        with self.lock:
            was = job.state
            if was in ("fetching", "running"):
                job.state, job.detail = "stopped", why
        process = job.process
        if process is None or process.poll() is not None:
            return
        log.info("assignment %s: stopping rank %d: %s", job.id, job.assignment.rank, why)
        process.send_signal(signal.SIGTERM)
        if not wait:
            threading.Thread(target=_end, args=(process,), daemon=True).start()
            return
        _end(process)

    def reap_forever(self) -> None:
        """Stop ranks whose serving machine stopped sending heartbeats; forget old jobs."""
        while not self.closing:
            time.sleep(REAP_INTERVAL)
            now = time.monotonic()
            with self.lock:
                jobs = list(self.jobs.values())
            for job in jobs:
                self._refresh(job)
                silent = now - job.last_seen
                if job.state in ("fetching", "running"):
                    if silent > job.assignment.heartbeat_timeout:
                        self._stop_job(
                            job, f"no heartbeat from the serving machine for {silent:.0f} s"
                        )
                elif silent > 600:
                    with self.lock:
                        self.jobs.pop(job.id, None)

    def close(self) -> None:
        self.closing = True
        with self.lock:
            jobs = list(self.jobs.values())
        for job in jobs:
            self._stop_job(job, "the node is stopping")


def node_id(models: Path) -> str:
    """This node's stable id (made once, kept beside its model files): two addresses of
    one machine are one node, so placement never puts two ranks on it by accident."""
    path = models / "node-id"
    try:
        found = path.read_text().strip()
    except OSError:
        found = ""
    if len(found) == 32 and all(c in "0123456789abcdef" for c in found):
        return found
    made = secrets.token_hex(16)
    try:
        models.mkdir(parents=True, exist_ok=True)
        path.write_text(made + "\n")
    except OSError as exc:
        log.warning("cannot keep this node's id in %s (%s): a new one each start", path, exc)
    return made


def _end(process: subprocess.Popen[bytes]) -> None:
    try:
        process.wait(STOP_GRACE)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        return int(sock.getsockname()[1])


class NodeHandler(BaseHTTPRequestHandler):
    agent: NodeAgent  # set on the subclass made by serve_node
    protocol_version = "HTTP/1.0"
    timeout = IDLE_TIMEOUT

    def do_GET(self) -> None:
        if not self._verified():
            return
        if self.path == "/v1/node":
            self._answer(200, self.agent.report())
        elif self.path.startswith("/v1/node/ranks/"):
            job = self.agent.heartbeat(self.path.rsplit("/", 1)[1])
            self._job_answer(job)
        else:
            self._answer(404, {"error": "not found"})

    def do_POST(self) -> None:
        if not self._verified():
            return
        if self.path != "/v1/node/ranks":
            self._answer(404, {"error": "not found"})
            return
        try:
            assignment = Assignment.model_validate_json(self._body)
        except ValidationError as exc:
            self._answer(400, {"error": f"invalid assignment: {exc.errors()[0]['msg']}"})
            return
        job = self.agent.assign(assignment, self.client_address[0])
        self._answer(202, job.view())

    def do_DELETE(self) -> None:
        if not self._verified():
            return
        if not self.path.startswith("/v1/node/ranks/"):
            self._answer(404, {"error": "not found"})
            return
        self._job_answer(
            self.agent.stop(self.path.rsplit("/", 1)[1], "stopped by the serving machine")
        )

    def _job_answer(self, job: RankJob | None) -> None:
        if job is None:
            self._answer(404, {"error": "no such assignment"})
        else:
            self._answer(200, job.view())

    def _verified(self) -> bool:
        """Read the body and check the request's signature; answer 4xx when it fails."""
        self._nonce: str | None = None
        header = self.headers.get("Content-Length")
        length = 0 if header is None and self.command != "POST" else _content_length(header)
        if length is None:
            self._answer(400, {"error": "a Content-Length (a whole number) is needed"})
            return False
        if length > MAX_BODY:
            self._answer(413, {"error": "request too large"})
            return False
        if length and self.command != "POST":
            self._answer(413, {"error": f"a {self.command} request carries no body"})
            return False
        self._body = self.rfile.read(length)
        self._local = endpoint(self.connection.getsockname())
        nonce, problem = self.agent.verifier.check(
            self.headers.get("Authorization"), self.command, self.path, self._body,
            local=self._local,
        )  # fmt: skip
        if nonce is None:
            log.info("refused %s %s from %s: %s", self.command, self.path,
                     self.client_address[0], problem)  # fmt: skip
            self._answer(401, {"error": problem})
            return False
        self._nonce = nonce
        return True

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        """The answer, signed for the request's nonce once the request was verified."""
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        nonce = getattr(self, "_nonce", None)
        if nonce is not None:
            signed = sign_response(self.agent.token, nonce, status, data, self._local)
            for name, value in signed.items():
                self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.client_address[0], *args)


class NodeServer(ThreadingHTTPServer):
    """One thread per connection, within ConnectionLimits (limits.py)."""

    daemon_threads = True
    request_queue_size = 64

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = ConnectionLimits(MAX_CONNECTIONS, MAX_PER_ADDRESS, CONNECTION_DEADLINE)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        return self.limits.admit(request, str(client_address[0]))

    def shutdown_request(self, request: Any) -> None:
        self.limits.release(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A peer that went away is a debug line: anyone on the LAN may connect and leave
        (the default printed a traceback to stderr each time); anything else is logged."""
        if isinstance(sys.exc_info()[1], OSError):
            log.debug("node API: %s went away: %s", client_address[0], sys.exc_info()[1])
        else:
            log.exception("node API: a request from %s failed", client_address[0])


def _content_length(header: str | None) -> int | None:
    try:
        length = int(header or "")
    except ValueError:
        return None
    return length if length >= 0 else None


@dataclass
class NodeSettings:
    cluster: str
    host: str
    port: int
    memory: int | None
    advertise: list[str]
    announce: bool
    models: Path


def serve_node(settings: NodeSettings, token: str) -> int:
    """Run the agent until SIGTERM / SIGINT (the caller checked the token: token_problem)."""
    from pipeserve import __version__
    from pipeserve.cluster.discovery import Announcement, own_addresses

    agent = NodeAgent(token, settings.cluster, settings.memory, settings.models)
    handler = type("Handler", (NodeHandler,), {"agent": agent})
    server = NodeServer((settings.host, settings.port), handler)
    port = int(server.server_address[1])
    threading.Thread(target=agent.reap_forever, daemon=True).start()
    announcement = None
    if settings.announce:
        addresses = settings.advertise or _announced(settings.host, own_addresses())
        announcement = Announcement(settings.cluster, port, addresses, __version__)
        log.info("announced on the LAN as cluster %r at %s port %d", settings.cluster,
                 ", ".join(addresses), port)  # fmt: skip
    report = machine_report(settings.memory)
    log.info("pipeserve node listening on %s:%d; offers %d bytes (%s), %s", settings.host, port,
             report["memory"]["usable"], report["memory"]["found_kind"] if settings.memory is None
             else "--memory", report["device_name"])  # fmt: skip
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    stop.wait()
    log.info("stopping: ranks first, then the announcement")
    agent.close()
    if announcement is not None:
        announcement.close()
    server.shutdown()
    return 0


def _announced(host: str, found: list[str]) -> list[str]:
    if host not in ("0.0.0.0", "", "::"):
        return [host]
    if not found:
        raise SystemExit("pipeserve node: no network address to announce (use --advertise)")
    return found


def rank_settings(assignment: Assignment, folder: Path, token: str) -> dict[str, str]:
    """What the rank reads from its stdin (peer.py): the group's token (derived from the
    cluster token, which the rank never gets) and settings, never in its environment or
    on its command line, where a process listing shows them."""
    return {
        "PIPESERVE_SHARD_RING": json.dumps(assignment.ring),
        "PIPESERVE_SHARD_CONTROL": assignment.control,
        "PIPESERVE_SHARD_TOKEN": group_secret(token, assignment.group_nonce),
        "PIPESERVE_SHARD_MODEL_DIR": str(folder),
        "PIPESERVE_SHARD_OPTIONS": assignment.options.model_dump_json(),
        "PIPESERVE_SHARD_NAME": assignment.model,
    }


def send_settings(process: subprocess.Popen[bytes], settings: dict[str, str]) -> None:
    """One line on the rank's stdin, left open: the rank ends when this process does."""
    assert process.stdin is not None
    try:
        process.stdin.write(json.dumps(settings).encode() + b"\n")
        process.stdin.flush()
    except OSError:  # the rank exited already: its state says so
        pass
