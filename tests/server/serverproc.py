"""Start a real `pipeserve serve` (gunicorn + gevent) on 127.0.0.1 for tests."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pipeserve_command() -> list[str]:
    script = shutil.which("pipeserve", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "pipeserve.cli"]


@contextmanager
def running_server(
    config: Path, env: dict[str, str] | None = None, startup_timeout: float = 240.0
) -> Iterator[str]:
    """Yield the base URL of a server started from `config`; stop it afterwards."""
    with server_process(config, env, startup_timeout) as (base, _):
        yield base


@contextmanager
def server_process(
    config: Path,
    env: dict[str, str] | None = None,
    startup_timeout: float = 240.0,
    prefix: list[str] | None = None,
    host: str = "127.0.0.1",
    ready: tuple[int, ...] = (200,),
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Like running_server, also yielding the process (to signal it). `prefix` runs the
    server through a command (`ip netns exec NS`), listening on `host`; it counts as up
    once /health answers one of the `ready` statuses."""
    port = free_port()
    log_path = server_log(port)
    full_env = {**os.environ, **(env or {})}
    serve = ["serve", "--config", str(config), "--port", str(port)]
    if host != "127.0.0.1":
        serve += ["--host", host]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*(prefix or []), *pipeserve_command(), *serve],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=REPO,
            start_new_session=True,
        )
        base = f"http://{host}:{port}"
        try:
            wait_healthy(base, proc, log_path, startup_timeout, ready)
            yield base, proc
        finally:
            stop(proc)


def server_log(port: int | str) -> Path:
    """Where the server on `port` (or its base URL) writes its log."""
    port = str(port).rsplit(":", 1)[-1]
    return Path(os.environ.get("PYTEST_SERVER_LOG_DIR", "/tmp")) / f"pipeserve-test-{port}.log"


def wait_healthy(
    base: str,
    proc: subprocess.Popen[bytes],
    log_path: Path,
    timeout: float,
    ready: tuple[int, ...] = (200,),
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}"
            )
        try:
            if healthy_status(httpx.get(f"{base}/health", timeout=2)) in ready:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop(proc)
    raise RuntimeError(f"server not healthy after {timeout}s:\n{log_path.read_text()[-4000:]}")


def healthy_status(answer: httpx.Response) -> int | None:
    """/health's status, None while the workers are still booting (503 "starting":
    server/booting.py), which no test waits for as its readiness."""
    try:
        starting = answer.status_code == 503 and answer.json().get("status") == "starting"
    except ValueError:
        starting = False
    return None if starting else answer.status_code


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
