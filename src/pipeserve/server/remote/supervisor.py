"""The master's handle on the engine host process: start, watch, restart, reload, stop.

The host is a fresh interpreter (`python -m pipeserve.server.remote.host`), never a
fork of the master: MLX must not be imported before a fork (serving.py). gunicorn's
master reaps every child with waitpid(-1), the host included, so a death is read from
`Popen.poll()`, which reports a child reaped by someone else as exited. The arbiter
calls `check()` on each turn of its loop (about once a second) and restarts a dead
host, backing off when it keeps dying.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger("pipeserve.serving")
READY_POLL = 0.1
STOP_WAIT = 30.0
MAX_BACKOFF = 30.0


class EngineHostProcess:
    """The engine host, or with `only` a sharded model's shard host (host.py)."""

    def __init__(
        self,
        snapshot: Path,
        socket_path: Path,
        log_format: str,
        log_level: str,
        only: str | None = None,
        *,
        secret: str,
    ) -> None:
        self.only = only
        self.secret = secret  # the server's secret (wire.py), handed over on stdin
        self.what = f"shard host of model {only}" if only else "engine host"
        self.snapshot = snapshot
        self.socket_path = socket_path
        self.log_format = log_format
        self.log_level = log_level
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._backoff = 1.0
        self._next_start = 0.0
        self._started_at = 0.0

    def start(self) -> None:
        import os

        command = [sys.executable, "-m", "pipeserve.server.remote.host",
                   "--snapshot", str(self.snapshot), "--socket", str(self.socket_path),
                   "--parent", str(os.getpid()), "--log-format", self.log_format,
                   "--log-level", self.log_level]  # fmt: skip
        if self.only:
            command += ["--only", self.only]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE)
        assert self.proc.stdin is not None
        try:  # never in argv or the environment: another user's ps shows those
            self.proc.stdin.write(f"{self.secret}\n".encode())
            self.proc.stdin.close()
        except OSError:  # it died at once: check() restarts it
            pass
        self._started_at = time.monotonic()
        log.info("%s started (pid %d)%s", self.what, self.proc.pid,
                 "" if self.only else ": one copy of each model for all workers")  # fmt: skip

    def wait_ready(self) -> bool:
        """At start-up: True once the host listens (its startup models are loaded), False
        when it died first. No time limit: loading a large model may take minutes."""
        while self.proc is not None and self.proc.poll() is None:
            if self.socket_path.exists():
                return True
            time.sleep(READY_POLL)
        return False

    def check(self) -> None:
        """From the arbiter's loop: restart the host if it died."""
        if self.proc is None or self.proc.poll() is None:
            return
        now = time.monotonic()
        if now < self._next_start:
            return
        # (no exit status: gunicorn's master may have reaped it first)
        log.warning("%s (pid %d) stopped; restarting it", self.what, self.proc.pid)
        if now - self._started_at > MAX_BACKOFF:  # it ran a while: not a crash loop
            self._backoff = 1.0
        self._next_start = now + self._backoff
        self._backoff = min(MAX_BACKOFF, self._backoff * 2)
        self.restarts += 1
        self.socket_path.unlink(missing_ok=True)
        self.start()

    def reload(self) -> None:
        """The config snapshot changed: the host applies it in place (SIGHUP)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGUSR1)
        try:
            proc.wait(STOP_WAIT)
        except subprocess.TimeoutExpired:
            log.error("%s (pid %d) did not stop; killing it", self.what, proc.pid)
            proc.kill()
            proc.wait()
