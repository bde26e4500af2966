"""An engine whose weights come and go: the Engine a fleet-managed model's stages see.

ManagedEngine wraps the real engine (mlx or replay) of one model. While the model is
resident, `submit` goes straight to the real engine. While it is not, `submit` returns a
PendingStream at once: the fleet loads the model in the background (other models keep
serving) and the stream yields KeepAlive until it can hand the job to the real engine, so
streaming clients get pings while they wait. Every submitted job counts as in flight until
its stream ends or is cancelled; a model with nothing in flight is idle and may be unloaded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pipeserve.engine.base import Engine, GenerationJob, TokenStream
from pipeserve.engine.embedding.engine import EmbeddingEngine
from pipeserve.engine.embedding.jobs import EmbedJob
from pipeserve.engine.embedding.ticket import EmbedTicket
from pipeserve.engine.weights.memory import release_free_memory
from pipeserve.errors import ApiError, refused_load
from pipeserve.events import ErrorEvent, Event, Finish, KeepAlive, PromptReady, Usage
from pipeserve.gevent_support import OsThreadHost, run_off_hub

if TYPE_CHECKING:
    from pipeserve.config.models import ModelEntry

log = logging.getLogger("pipeserve.fleet")
State = Literal["unloaded", "loading", "loaded"]
DEFAULT_WAIT_PING = 5.0


class Ticket:
    """One waiting request's view of a load: wait() -> None (not yet), True or the error."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.result: bool | ApiError | None = None

    def set(self, result: bool | ApiError) -> None:
        self.result = result
        self._event.set()

    def wake(self) -> None:
        self._event.set()

    def wait(self, timeout: float) -> bool | ApiError | None:
        if not self._event.wait(timeout):
            return None
        return self.result if self.result is not None else True


class LoadQueue(Protocol):
    """What a managed engine asks of its fleet (pipeserve.server.fleet.Fleet)."""

    def request_load(self, engine: ManagedEngine) -> Ticket: ...

    def notify(self) -> None: ...


def weights_bytes(model_dir: Path) -> int:
    """Bytes of the weights as stored (safetensors files): the budget's estimate of a model."""
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def draft_bytes(draft: ModelEntry | None) -> int:
    """The weights of a draft model that loads inside the engine it drafts for."""
    if draft is None:
        return 0
    from pipeserve.engine.weights.loader import resolve_source

    return weights_bytes(resolve_source(draft.source, draft.sha256))


class ManagedEngine:
    def __init__(
        self,
        name: str,
        start: Callable[..., Engine],
        fleet: LoadQueue,
        *,
        pinned: bool,
        keep_alive: float | None,
        size: int,
        accepts_mock_response: bool,
        max_tokens_limit: int | None,
        hosted: bool = False,
    ) -> None:
        self.name = name
        self.fleet = fleet
        self.pinned = pinned  # load: startup -- never unloaded while configured
        self.keep_alive = keep_alive
        self.size = size
        self.accepts_mock_response = accepts_mock_response
        self.max_tokens_limit = max_tokens_limit
        self.state: State = "unloaded"
        self.engine: Engine | None = None
        self.in_flight = 0
        self.last_used = time.monotonic()
        self.retired = False
        self.load_error: ApiError | None = None
        self.load_started = 0.0  # monotonic time the current (or last) load began
        self.changed = threading.Event()  # set whenever a load attempt ends
        self._start = start
        # hosted: start(host=...) runs the engine on this model's one reusable OS thread
        self._hosted = hosted
        self._host: OsThreadHost | None = None

    # -- request side -----------------------------------------------------------------

    def submit(self, job: GenerationJob) -> TokenStream:
        # A retired model (removed or replaced by a reload) still serves the requests that
        # were routed to it before the reload: their prompts were made with its tokenizer.
        if self.engine is not None:
            return self.submit_loaded(job)
        return PendingStream(self, job)

    def submit_loaded(self, job: GenerationJob) -> TokenStream:
        assert self.engine is not None
        stream = self.engine.submit(job)  # may raise overloaded: nothing is in flight then
        self.acquire()
        return TrackedStream(stream, self.release)

    def embed(self, job: EmbedJob, timeout: float) -> EmbedTicket:
        """Queue an embedding job, loading the model first when it is not resident (the
        caller waits: embeddings answer once, with no stream to ping). ApiError:
        overloaded (429), a load that failed or did not finish within `timeout`."""
        self.acquire()
        try:
            engine = self._resident(timeout)
            if not isinstance(engine, EmbeddingEngine):
                raise ApiError("invalid_request", f"model {self.name} does not embed", "model")
            ticket = engine.embed(job)
        except BaseException:
            self.release()
            raise
        ticket.on_done(self.release)
        return ticket

    def _resident(self, timeout: float) -> Engine:
        deadline = time.monotonic() + timeout
        while self.engine is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ApiError("timeout", f"model {self.name} did not load within {timeout:.0f} s")
            outcome = self.fleet.request_load(self).wait(left)
            if isinstance(outcome, ApiError):
                raise outcome
        return self.engine

    def acquire(self) -> None:
        self.in_flight += 1
        self.last_used = time.monotonic()

    def release(self) -> None:
        self.in_flight -= 1
        self.last_used = time.monotonic()
        self.fleet.notify()

    def stats(self) -> dict[str, float]:
        engine = self.engine
        out = dict(engine.stats()) if engine is not None else {}
        out.update(resident=int(self.state == "loaded"), memory_bytes=self.memory_bytes())
        return out

    def memory_bytes(self) -> int:
        """Weights as stored plus the live prefix cache, while resident."""
        engine = self.engine
        if self.state == "unloaded" or engine is None:
            return self.size if self.state == "loading" else 0
        return self.size + int(engine.stats().get("prefix_cache_bytes", 0))

    @property
    def healthy(self) -> bool:
        """A model that is not resident is healthy: it loads on the next request."""
        engine = self.engine
        return engine is None or engine.healthy

    @property
    def health_reason(self) -> str:
        engine = self.engine
        return "" if engine is None else engine.health_reason

    def describe(self) -> dict[str, Any]:
        """What /v1/models says about this model's residency (and why its last load
        failed, while it is not resident)."""
        facts: dict[str, Any] = {
            "state": {"loaded": "loaded", "loading": "loading"}.get(self.state, "not-loaded"),
            "load": "startup" if self.pinned else "on_demand",
            "memory_bytes": self.memory_bytes(),
        }
        if self.load_error is not None and self.state == "unloaded":
            facts["load_error"] = self.load_error.message
        if self.state == "loading":  # no load reports its progress; its time so far
            facts["loading_seconds"] = round(time.monotonic() - self.load_started, 1)
        engine = self.engine
        if engine is not None:  # the loaded engine's own facts (adapters it refused)
            facts.update(engine.describe())
        return facts

    # -- fleet side ---------------------------------------------------------------------

    def load(self) -> None:
        """Start the real engine (blocking off the hub). The fleet serializes this."""
        self.mark_loading()
        self.changed.clear()
        started = self.load_started
        start = self._start
        if self._hosted:
            self._host = self._host or OsThreadHost(f"pipeserve-engine-{self.name}")
            start = partial(self._start, host=self._host)
        try:
            self.engine = run_off_hub(start)
        except Exception as exc:  # a model that cannot load: its requests get the reason
            if refused_load(exc) is None:  # else the caller reports the reason (one line)
                log.exception("model %s failed to load", self.name)
            self.state = "unloaded"
            self.load_error = ApiError("unavailable", f"model {self.name} failed to load: {exc}")
            raise self.load_error from exc
        finally:
            self.changed.set()
        self.state = "loaded"
        self.load_error = None
        log.info("model %s loaded in %.1f s", self.name, time.monotonic() - started)

    def mark_loading(self) -> None:
        if self.state != "loading":
            self.state, self.load_started = "loading", time.monotonic()

    def unload(self, reason: str) -> None:
        engine, self.engine = self.engine, None
        self.state = "unloaded"
        if engine is not None:
            run_off_hub(engine.close)
            try:
                run_off_hub(release_free_memory)
            except Exception:  # best effort: the model is unloaded either way
                log.exception("model %s: returning freed memory to the system failed", self.name)
        log.info("model %s unloaded (%s)", self.name, reason)

    def close(self) -> None:
        self.retired = True
        self.unload("worker stopping")


class TrackedStream:
    """A real engine's stream that releases its model's in-flight count exactly once."""

    def __init__(self, inner: TokenStream, release: Callable[[], None]) -> None:
        self.inner = inner
        self._release = release
        self._released = False

    def __iter__(self) -> Iterator[Event]:
        try:
            yield from self.inner
        finally:
            self.done()

    def cancel(self) -> None:
        self.inner.cancel()
        self.done()

    def done(self) -> None:
        if not self._released:
            self._released = True
            self._release()


class PendingStream:
    """The stream of a job whose model is not resident yet: pings until it is, then the
    real stream. A model that cannot be loaded (or does not fit) ends the stream with an
    in-protocol error."""

    def __init__(self, managed: ManagedEngine, job: GenerationJob) -> None:
        self.managed = managed
        self.job = job
        self.inner: TokenStream | None = None
        self._cancelled = False
        self._done = False
        managed.acquire()  # waiting clients keep the model from being chosen for eviction
        self._ready = managed.fleet.request_load(managed)

    def __iter__(self) -> Iterator[Event]:
        try:
            yield from self._wait()
            if self._cancelled or self.inner is None:
                return
            yield from self.inner
        finally:
            self._finish()

    def _wait(self) -> Iterator[Event]:
        ping = self.job.keepalive_interval or DEFAULT_WAIT_PING
        while self.managed.engine is None and not self._cancelled:
            outcome = self._ready.wait(ping)
            if outcome is None:
                yield KeepAlive()
            elif isinstance(outcome, ApiError):
                yield from self._error(outcome)
                return
            elif self.managed.engine is None and not self._cancelled:
                self._ready = self.managed.fleet.request_load(self.managed)  # loaded, then lost
        if self._cancelled:
            yield from self._end("cancelled")
            return
        try:
            self.inner = self.managed.submit_loaded(self.job)
        except ApiError as error:
            yield from self._error(error)

    def _error(self, error: ApiError) -> Iterator[Event]:
        yield PromptReady(len(self.job.prompt_token_ids))
        yield ErrorEvent(error.kind, error.message)
        yield Finish("error")
        yield Usage(len(self.job.prompt_token_ids), 0)

    def _end(self, reason: Any) -> Iterator[Event]:
        yield PromptReady(len(self.job.prompt_token_ids))
        yield Finish(reason)
        yield Usage(len(self.job.prompt_token_ids), 0)

    def cancel(self) -> None:
        self._cancelled = True
        if self.inner is not None:
            self.inner.cancel()
        self._ready.wake()
        self._finish()

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self.managed.release()
