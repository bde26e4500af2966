"""Benchmark servers on 127.0.0.1: pipeserve and mlx_lm.server, started, paused and stopped.

Both benchmarks that compare served numbers (serve_bench, burst_bench) keep every server
up for the whole run and measure one at a time: the idle ones are stopped with SIGSTOP
(their whole process group), so rounds can alternate between them on a shared machine
and each cell's median compares servers under the same background load.
"""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeserve import blas
from tests.server.serverproc import free_port, stop

REPO = Path(__file__).resolve().parents[1]
STARTUP_SECONDS = 300.0


@dataclass
class BenchServer:
    """A running server: `model` is the name requests use."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int
    model: str

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def pause(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    @contextmanager
    def active(self) -> Iterator[BenchServer]:
        """Resumed for the block, paused again after it."""
        self.resume()
        try:
            yield self
        finally:
            self.pause()

    def stop(self) -> None:
        self.resume()  # a stopped process group would not see SIGTERM until continued
        stop(self.proc)


def bench_environment(home: Path, blas_threads: str = "") -> dict[str, str]:
    """This environment with OpenBLAS preloaded (the same BLAS for every server);
    `blas_threads` sets OPENBLAS_NUM_THREADS ('' keeps OpenBLAS's default)."""
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.MARKER)}
    env = {**base, **(blas.openblas_environment(home) or {})}
    if blas_threads:
        env["OPENBLAS_NUM_THREADS"] = blas_threads
    return env


def run_with_blas(child_marker: str, blas_threads: str, body: Callable[[], None]) -> int:
    """Run `body` in a child process whose environment preloads OpenBLAS
    (bench_environment; the preload must be in place before the interpreter starts):
    this very command runs again there with `child_marker` set, and runs `body`.
    Returns the exit code."""
    if os.environ.get(child_marker):
        body()
        return 0
    from pipeserve.settings import pipeserve_home

    env = {**bench_environment(pipeserve_home(), blas_threads), child_marker: "1"}
    return subprocess.run([sys.executable, *sys.argv], env=env, check=False).returncode


def plain_environment() -> dict[str, str]:
    """This environment without pipeserve's BLAS preload (each server as installed)."""
    return {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.MARKER)}


def start_pipeserve(
    model_dir: Path,
    work: Path,
    env: Mapping[str, str],
    options: Mapping[str, Any],
    pipeline: str = "qwen3",
    name: str = "pipeserve",
) -> BenchServer:
    """`pipeserve serve` with one model called `bench` and the OpenAI Chat endpoint."""
    port = free_port()
    rendered = ", ".join(f"{key}: {value}" for key, value in options.items())
    config = work / f"{name}.yaml"
    config.write_text(
        f"pipelines_dir: {REPO / 'pipelines'}\n"
        f"models:\n  - name: bench\n    source: {model_dir}\n    pipeline: {pipeline}\n"
        f"    options: {{{rendered}}}\n"
        "endpoints:\n  - {route: /v1/chat/completions, api: openai-chat}\n"
    )
    cmd = [sys.executable, "-m", "pipeserve.cli", "serve", "--config", str(config)]
    proc = launch([*cmd, "--port", str(port)], env, port, "/health", work / f"{name}.log")
    return BenchServer(name, proc, port, "bench")


def start_mlx_lm(
    model_dir: Path, work: Path, env: Mapping[str, str], name: str = "mlx_lm.server"
) -> BenchServer:
    """`mlx_lm.server` with its defaults; requests name the model by its folder."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir)]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    proc = launch(cmd, env, port, "/v1/models", work / f"{name}.log")
    return BenchServer(name, proc, port, str(model_dir))


def launch(
    cmd: list[str], env: Mapping[str, str], port: int, ready_path: str, log: Path
) -> subprocess.Popen[bytes]:
    """Start `cmd` in its own process group; return once `ready_path` answers 200."""
    proc = subprocess.Popen(
        cmd,
        env=dict(env),
        cwd=REPO,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:4]} exited:\n{log.read_text()[-3000:]}")
        if answers(port, ready_path):
            return proc
        time.sleep(0.3)
    stop(proc)
    raise RuntimeError(f"{cmd[:4]} did not start in {STARTUP_SECONDS:.0f} s")


def answers(port: int, path: str) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", path)
        return conn.getresponse().status == 200
    except OSError:
        return False
