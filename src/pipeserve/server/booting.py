"""A worker's app while it boots: /health and /v1/models answer at once, 503 "starting".

gunicorn binds the port in the master and forks the workers; each worker then built
every model's tokenizer and stage chain and, with one worker, loaded the weights, all
before its first `accept`. Every request sent meanwhile, a readiness probe's included,
queued unanswered (a fresh start: tens of seconds). Now the worker's app is this one from
the first moment: it accepts at once and builds the real app (`boot`) in the background,
every load on OS threads (run_off_hub), so that the hub keeps answering. The server's
imports (seconds) are done by the master before it binds (serving.import_the_server), so
a forked worker answers within milliseconds of the bind:

- `/health`: 503 {"status": "starting", ...} with Retry-After until the real app is
  built, then the real app answers (200 once the models are ready, 503 naming any that
  is not, as before);
- `/v1/models` (and `/v1/models/{id}`): 503 with an error in the OpenAI shape (which
  the Anthropic SDK reads too), `code: "starting"`;
- every other request waits for the real app, as it waited in the listen queue before.

A build that fails ends the worker with gunicorn's boot error (the master then stops,
as when a worker failed to boot). A reload signalled while booting applies once built.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger("pipeserve.serving")
RETRY_AFTER = "1"
BOOT_SWITCH_INTERVAL = 0.001  # seconds (Python's default: 0.005)
STARTING = "the server is starting: its models are loading"


class BootingApp:
    def __init__(
        self, models: list[str], build: Callable[[], Any], prepare: Callable[[], None]
    ) -> None:
        """`prepare` (the server's imports: done by the master already, so instant),
        then `build` (the real app: its loads go off the hub themselves), both in the
        booting greenlet."""
        import gevent.event

        self.models = models
        self._build = build
        self._prepare = prepare
        self.live: Any = None  # the real app (LiveApp) once built
        self._built = gevent.event.Event()
        self._pending_reload: Any = None

    def boot(self) -> None:
        """Build the real app (from a greenlet of the running worker); raises its error.

        The imports (`prepare`) run here, on the hub, and find every module imported
        by the master. (With them on an OS thread a request stalled its worker for
        minutes twice in about a dozen starts: under gevent's monkey patching the
        interpreter's module locks are gevent locks, held across threads.) The build's
        loads (tokenizers, weights, warm-up) run off the hub and are answered "starting". The OS threads that load hand the GIL back every
        millisecond (not 5): each answer waits for the GIL at each of its socket calls."""
        interval = sys.getswitchinterval()
        sys.setswitchinterval(BOOT_SWITCH_INTERVAL)
        try:
            self._prepare()
            self.live = self._build()
        finally:
            sys.setswitchinterval(interval)
        self._built.set()
        if self._pending_reload is not None:
            self.live.reload(self._pending_reload)

    def reload(self, loaded: Any) -> bool:
        """A config reload (reload.reload_worker): applied now, or once booted."""
        if self.live is not None:
            return bool(self.live.reload(loaded))
        self._pending_reload = loaded
        log.info("reload: applied once this worker has booted")
        return False

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        if self.live is None:
            path = environ.get("PATH_INFO") or "/"
            if path == "/health":
                return self._starting(environ, start_response, self._health())
            if path == "/v1/models" or path.startswith("/v1/models/"):
                return self._starting(environ, start_response, self._models_error())
            self._built.wait()
        return self.live(environ, start_response)  # type: ignore[no-any-return]

    def _health(self) -> dict[str, Any]:
        return {
            "status": "starting",
            "models": self.models,
            "unhealthy": {name: STARTING for name in self.models},
        }

    @staticmethod
    def _models_error() -> dict[str, Any]:
        error = {"message": STARTING, "type": "server_error", "param": None, "code": "starting"}
        return {"type": "error", "error": error}

    @staticmethod
    def _starting(
        environ: dict[str, Any], start_response: Any, body: dict[str, Any]
    ) -> Iterable[bytes]:
        data = json.dumps(body).encode()
        headers = [("Content-Type", "application/json"), ("Content-Length", str(len(data))),
                   ("Retry-After", RETRY_AFTER), ("Cache-Control", "no-store")]  # fmt: skip
        start_response("503 Service Unavailable", headers)
        return [] if environ.get("REQUEST_METHOD") == "HEAD" else [data]
