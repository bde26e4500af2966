"""EngineThread: the OS-thread life shared by MlxEngine and EmbeddingEngine.

One OS thread per model loads it, serves an inbox of messages until a close message,
then frees the model on that thread (MLX arrays and streams belong to the thread that
made them: docs/architecture.md, "Threading model"). The inbox blocks the OS thread,
never the gevent hub. Admission (max_batch + queue_size requests in flight, then 429
with Retry-After) and close are the same for every engine; what a message does, what
one loop turn runs and how the model is set up and freed are the subclass's.
"""

from __future__ import annotations

import gc
import itertools
import logging
import queue
from typing import Any, Generic, TypeVar

import mlx.core as mx

from pipeserve.config.models import EngineOptions
from pipeserve.engine.base import AlwaysHealthy
from pipeserve.errors import ApiError, refused_load
from pipeserve.gevent_support import OsFlag, OsThreadHost, os_lock, os_simple_queue, start_os_thread

log = logging.getLogger("pipeserve.engine")

RETRY_AFTER_SECONDS = 1.0
MAX_RETRY_AFTER = 60.0
CLOSE = ("close",)
S = TypeVar("S")  # what the engine thread holds while it serves (the loaded model's state)


class EngineThread(AlwaysHealthy, Generic[S]):
    """Subclasses set their own fields, call `super().__init__`, then `_launch`."""

    def __init__(self, name: str, options: EngineOptions) -> None:
        self.name = name
        self.options = options
        self._capacity = options.max_batch + options.queue_size
        self._inbox = os_simple_queue()
        self._lock = os_lock()
        self._in_flight = 0
        self._closed = False
        self._keys = itertools.count(1)
        self._stats: dict[str, float] = {"requests_total": 0, "overloaded_total": 0}
        self._load_error: BaseException | None = None
        self._loaded = OsFlag()
        self._stopped = OsFlag()

    def _launch(self, host: OsThreadHost | None, thread_name: str) -> None:
        """Start serving on `host`'s thread (a reused one) or a new one; wait for the load."""
        if host is not None:  # a reused thread: it returns to its host when the engine stops
            host.run(self._serve)
        else:
            start_os_thread(self._run, name=thread_name)
        self._loaded.wait()
        if self._load_error is not None:
            raise RuntimeError(
                f"model {self.name}: loading failed: {self._load_error}"
            ) from self._load_error

    # -- request side (any thread / greenlet) ------------------------------------

    def _admit(self) -> None:
        with self._lock:
            if self._closed:
                raise ApiError("unavailable", f"model {self.name} is shutting down")
            if self._in_flight >= self._capacity:
                self._stats["overloaded_total"] += 1
                raise ApiError(
                    "overloaded",
                    f"model {self.name} is at capacity ({self._in_flight} requests in flight);"
                    " retry later",
                    retry_after=self._retry_after(),
                )
            self._in_flight += 1
            self._stats["requests_total"] += 1

    def _retry_after(self) -> float:
        """Seconds until a place is likely free (Retry-After of a 429)."""
        mean = float(self._stats.get("mean_request_seconds") or RETRY_AFTER_SECONDS)
        return min(MAX_RETRY_AFTER, max(RETRY_AFTER_SECONDS, mean))

    def _release(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def close(self, timeout: float = 10.0) -> None:
        """Stop: requests still running end with an error; later submits are refused."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._inbox.put(CLOSE)
        self._stopped.wait(timeout)

    # -- engine thread ------------------------------------------------------------

    def _run(self) -> None:
        self._serve()
        self._park()

    def _park(self) -> None:
        """Never let the engine thread exit.

        MLX keeps a per-thread compile cache whose thread-exit destructor takes the
        GIL; if that races with interpreter shutdown the process aborts ("terminate
        called without an active exception"). A parked daemon thread never runs it.
        """
        while True:
            self._inbox.get()

    def _serve(self) -> None:
        """Load, serve until closed, free the model; returns (the caller parks or reuses)."""
        try:
            state = self._open()
        except BaseException as exc:  # reported to the constructor's caller
            if refused_load(exc) is None:
                log.exception("model %s failed to load", self.name)
            self._load_error = exc
            self._loaded.set()
            self._stopped.set()
            return
        self._loaded.set()
        try:
            self._loop(state)
        finally:
            self._shut(state)
            del state  # free MLX state on the thread that made it (mlx_lm.server does too)
            try:
                mx.synchronize()
            except RuntimeError:  # a sharded model's ring reports its closed peers here
                log.debug("model %s: synchronize at close failed", self.name, exc_info=True)
            gc.collect()
            self._stopped.set()

    def _drain(self, state: S, block: bool) -> bool:
        """Apply every pending message; False when the engine must stop."""
        while True:
            try:
                message = self._inbox.get() if block else self._inbox.get(block=False)
            except queue.Empty:
                return True
            block = False
            if message[0] == "close":
                return False
            self._handle(state, message)

    def _open(self) -> S:
        """Load the model (on the engine thread); what `_loop` and `_shut` work on."""
        raise NotImplementedError

    def _loop(self, state: S) -> None:
        """Serve until `_drain` says stop."""
        raise NotImplementedError

    def _handle(self, state: S, message: tuple[Any, ...]) -> None:
        """Apply one inbox message other than close."""
        raise NotImplementedError

    def _shut(self, state: S) -> None:
        """End what is still running and drop the model's references (before the free)."""
        raise NotImplementedError
