"""EmbeddingEngine: one OS thread per embedding / rerank model, like MlxEngine's.

Requests reach the thread through an inbox that blocks the OS thread, never the gevent
hub. Each loop turn the thread applies every pending message (a new job's inputs join
the waiting pool, a cancelled job's leave it), encodes one padded batch made of the
inputs of every waiting request (batches.py), and hands each job its result as soon as
its last input is done. Admission is MlxEngine's: max_batch + queue_size requests in
flight, then 429 with Retry-After.
"""

from __future__ import annotations

import gc
import itertools
import logging
import queue
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from pipeserve.config.models import EngineOptions
from pipeserve.engine.base import AlwaysHealthy, GenerationJob, TokenStream
from pipeserve.engine.embedding.backbone import Backbone
from pipeserve.engine.embedding.batches import Item, Pending, WaitingPool, lay_out
from pipeserve.engine.embedding.jobs import EmbedJob, EmbedResult
from pipeserve.engine.embedding.mailbox import Mailbox
from pipeserve.engine.embedding.pooling import finish, pool
from pipeserve.engine.embedding.spec import EmbeddingSpec
from pipeserve.engine.embedding.ticket import EmbedTicket
from pipeserve.engine.embedding.yielding import Yielding
from pipeserve.errors import ApiError
from pipeserve.gevent_support import (
    OsFlag,
    OsThreadHost,
    os_lock,
    os_simple_queue,
    os_sleep,
    start_os_thread,
)

log = logging.getLogger("pipeserve.engine")
RETRY_AFTER_SECONDS = 1.0
MAX_RETRY_AFTER = 60.0


class EmbeddingEngine(AlwaysHealthy):
    accepts_mock_response = False
    max_tokens_limit: int | None = None

    def __init__(
        self,
        name: str,
        load: Callable[[], Backbone],
        spec: EmbeddingSpec,
        options: EngineOptions,
        batch_tokens: int,
        host: OsThreadHost | None = None,
        yielding: Yielding | None = None,
    ) -> None:
        self.name = name
        self.yielding = yielding or Yielding()
        self.spec = spec
        self.options = options
        self.batch_tokens = batch_tokens
        self._capacity = options.max_batch + options.queue_size
        self._inbox = os_simple_queue()
        self._lock = os_lock()
        self._keys = itertools.count(1)
        self._in_flight = 0
        self._closed = False
        self._stats: dict[str, float] = {
            "requests_total": 0,
            "overloaded_total": 0,
            "embedded_inputs_total": 0,
            "embedded_tokens_total": 0,
            "batches_total": 0,
        }
        self._active = 0
        self._load = load
        self._load_error: BaseException | None = None
        self._loaded = OsFlag()
        self._stopped = OsFlag()
        self.backbone: Backbone | None = None
        if host is not None:
            host.run(self._serve)
        else:
            start_os_thread(self._run, name=f"pipeserve-embed-{name}")
        self._loaded.wait()
        if self._load_error is not None:
            raise RuntimeError(
                f"model {name}: loading failed: {self._load_error}"
            ) from self._load_error

    # -- request side -------------------------------------------------------------

    def submit(self, job: GenerationJob) -> TokenStream:
        raise ApiError(
            "invalid_request",
            f"model {self.name} is an embedding model; it does not generate text",
            "model",
        )

    def embed(self, job: EmbedJob) -> EmbedTicket:
        """Queue a job (ApiError overloaded: too many in flight)."""
        self._admit()
        key = next(self._keys)
        mailbox = Mailbox()
        self._inbox.put(("submit", Pending(key, job, mailbox)))
        return EmbedTicket(mailbox, lambda: self._inbox.put(("cancel", key)))

    def _admit(self) -> None:
        with self._lock:
            if self._closed:
                raise ApiError("unavailable", f"model {self.name} is shutting down")
            if self._in_flight >= self._capacity:
                self._stats["overloaded_total"] += 1
                mean = float(self._stats.get("mean_request_seconds") or RETRY_AFTER_SECONDS)
                raise ApiError(
                    "overloaded",
                    f"model {self.name} is at capacity ({self._in_flight} requests in flight);"
                    " retry later",
                    retry_after=min(MAX_RETRY_AFTER, max(RETRY_AFTER_SECONDS, mean)),
                )
            self._in_flight += 1
            self._stats["requests_total"] += 1

    def _release(self, pending: Pending) -> None:
        seconds = time.monotonic() - pending.started
        with self._lock:
            self._in_flight -= 1
            mean = self._stats.get("mean_request_seconds", seconds)
            self._stats["mean_request_seconds"] = 0.9 * mean + 0.1 * seconds

    def stats(self) -> dict[str, float]:
        out = dict(self._stats)
        out["in_flight"] = self._in_flight
        out["active_sequences"] = self._active
        out["queue_depth"] = max(0, self._in_flight - (1 if self._active else 0))
        return out

    def describe(self) -> dict[str, Any]:
        return {}

    def close(self, timeout: float = 10.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._inbox.put(("close",))
        self._stopped.wait(timeout)

    # -- engine thread -------------------------------------------------------------

    def _run(self) -> None:
        self._serve()
        while True:  # never exit: see MlxEngine._park
            self._inbox.get()

    def _serve(self) -> None:
        try:
            self.backbone = self._load()
        except BaseException as exc:  # reported to the constructor's caller
            log.exception("model %s failed to load", self.name)
            self._load_error = exc
            self._loaded.set()
            self._stopped.set()
            return
        self._load = lambda: None  # type: ignore[assignment,return-value]
        self._loaded.set()
        pool_ = WaitingPool()
        try:
            self._loop(pool_)
        finally:
            for pending in pool_.all_jobs():
                self._deliver(pool_, pending, "unavailable", f"model {self.name} stopped")
            self.backbone = None
            mx.synchronize()
            gc.collect()
            self._stopped.set()

    def _loop(self, pool_: WaitingPool) -> None:
        while self._drain(pool_, block=pool_.empty):
            if pool_.empty:
                continue
            chat = self.yielding.chat_running()
            batch = pool_.next_batch(self.yielding.budget(self.batch_tokens, chat))
            self._active = len(batch)
            started = time.monotonic()
            try:
                self._encode(pool_, batch)
            except Exception as exc:  # a bug must not kill the engine thread
                log.exception("embedding batch failed; failing its requests")
                for pending in {id(i.pending): i.pending for i in batch}.values():
                    pool_.remove(pending.key)
                    message = f"engine fault: {type(exc).__name__}: {exc}"
                    self._deliver(pool_, pending, "internal", message)
            self._active = 0
            if chat:
                os_sleep(self.yielding.pause(time.monotonic() - started))

    def _drain(self, pool_: WaitingPool, block: bool) -> bool:
        while True:
            try:
                message = self._inbox.get() if block else self._inbox.get(block=False)
            except queue.Empty:
                return True
            block = False
            if message[0] == "submit":
                pool_.add(message[1])
            elif message[0] == "cancel":
                pending = pool_.remove(message[1])
                if pending is not None:
                    self._deliver(pool_, pending, "cancelled", "cancelled")
            else:
                return False

    def _encode(self, pool_: WaitingPool, batch: list[Item]) -> None:
        backbone = self.backbone
        assert backbone is not None
        layout = lay_out(batch)
        ids, mask = mx.array(layout.ids), mx.array(layout.mask)
        lengths = mx.array(layout.lengths)
        hidden = backbone.hidden(ids, mask, mx.array(layout.types))
        scoring = [i for i, item in enumerate(batch) if item.pending.job.mode == "score"]
        pooled = pool(hidden, mask, lengths, self.spec.pooling).astype(mx.float32)
        scores = backbone.score(hidden, lengths) if scoring else None
        mx.eval(pooled, *([scores] if scores is not None else []))
        vectors = np.array(pooled)
        values = np.array(scores) if scores is not None else None
        self._stats["batches_total"] += 1
        self._stats["embedded_inputs_total"] += len(batch)
        self._stats["embedded_tokens_total"] += int(layout.lengths.sum())
        for row, item in enumerate(batch):
            self._store(pool_, item, vectors[row], None if values is None else float(values[row]))

    def _store(
        self, pool_: WaitingPool, item: Item, vector: np.ndarray, score: float | None
    ) -> None:
        pending = item.pending
        if pending.done:
            return
        job = pending.job
        if job.mode == "embed":
            pending.result.vectors[item.index] = finish(vector, job.dimensions, self.spec.normalize)
        else:
            pending.result.scores[item.index] = float(score if score is not None else 0.0)
        pending.left -= 1
        if pending.left == 0:
            self._deliver(pool_, pending, None, None)

    def _deliver(self, pool_: WaitingPool, pending: Pending, kind: Any, error: str | None) -> None:
        if pending.done:
            return
        pending.done = True
        pool_.finished(pending)
        if kind is not None:
            pending.result = EmbedResult(tokens=pending.result.tokens, error=error, error_kind=kind)
        pending.mailbox.put(pending.result)
        self._release(pending)
