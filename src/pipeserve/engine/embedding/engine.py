"""EmbeddingEngine: one OS thread per embedding / rerank model, like MlxEngine's.

Requests reach the thread through an inbox that blocks the OS thread, never the gevent
hub. Each loop turn the thread applies every pending message (a new job's inputs join
the waiting pool, a cancelled job's leave it), encodes one padded batch made of the
inputs of every waiting request (batches.py), and hands each job its result as soon as
its last input is done. The thread's life and admission (max_batch + queue_size
requests in flight, then 429 with Retry-After) are MlxEngine's (engine/mlx/engine_thread.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from pipeserve.config.models import EngineOptions
from pipeserve.engine.base import GenerationJob, TokenStream
from pipeserve.engine.embedding.backbone import Backbone
from pipeserve.engine.embedding.batches import Item, Layout, Pending, WaitingPool, lay_out, pack
from pipeserve.engine.embedding.jobs import EmbedJob, EmbedResult
from pipeserve.engine.embedding.mailbox import Mailbox
from pipeserve.engine.embedding.spec import EmbeddingSpec
from pipeserve.engine.embedding.ticket import EmbedTicket
from pipeserve.engine.embedding.yielding import Yielding
from pipeserve.engine.mlx.engine_thread import EngineThread
from pipeserve.errors import ApiError
from pipeserve.gevent_support import OsThreadHost, os_sleep

log = logging.getLogger("pipeserve.engine")


class EmbeddingEngine(EngineThread[WaitingPool]):
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
        super().__init__(name, options)
        self.yielding = yielding or Yielding()
        self.spec = spec
        self.batch_tokens = batch_tokens
        self._stats.update(
            embedded_inputs_total=0, embedded_tokens_total=0, batches_total=0,
            yielded_batches_total=0,  # batches run while chat decoded (made small, paused)
        )  # fmt: skip
        self._active = 0
        self._load = load
        self.backbone: Backbone | None = None
        self._launch(host, f"pipeserve-embed-{name}")

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

    def _finished(self, pending: Pending) -> None:
        seconds = time.monotonic() - pending.started
        self._release()
        with self._lock:
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

    # -- engine thread -------------------------------------------------------------

    def _open(self) -> WaitingPool:
        self.backbone = self._load()
        self._load = lambda: None  # type: ignore[assignment,return-value]
        return WaitingPool()

    def _shut(self, pool_: WaitingPool) -> None:
        for pending in pool_.all_jobs():
            self._deliver(pool_, pending, "unavailable", f"model {self.name} stopped")
        self.backbone = None

    def _loop(self, pool_: WaitingPool) -> None:
        while self._drain(pool_, block=pool_.empty):
            if pool_.empty:
                continue
            chat = self.yielding.chat_running()
            budget = self.yielding.budget(self.batch_tokens, chat)
            packs = self.backbone is not None and self.backbone.packs
            batch = pool_.next_batch(budget, padded=not packs)
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
                self._stats["yielded_batches_total"] += 1
                os_sleep(self.yielding.pause(time.monotonic() - started))

    def _handle(self, pool_: WaitingPool, message: tuple[Any, ...]) -> None:
        if message[0] == "submit":
            pool_.add(message[1])
        elif message[0] == "cancel":
            pending = pool_.remove(message[1])
            if pending is not None:
                self._deliver(pool_, pending, "cancelled", "cancelled")

    def _encode(self, pool_: WaitingPool, batch: list[Item]) -> None:
        """One padded batch: each input's token vectors (embed: the chain's pool stage
        makes one vector of them) or its relevance score (rerank)."""
        backbone = self.backbone
        assert backbone is not None
        scoring = any(item.pending.job.mode == "score" for item in batch)
        if backbone.packs:
            layout = pack(batch)
            packed = backbone.packed(layout.ids, layout.types, layout.lengths, scoring)
            starts = np.concatenate([[0], np.cumsum(layout.lengths)])
            rows = [packed[row] if scoring else packed[starts[row] : starts[row + 1]]
                    for row in range(len(batch))]  # fmt: skip
        else:
            layout, rows = self._padded(backbone, batch, scoring)
        self._stats["batches_total"] += 1
        self._stats["embedded_inputs_total"] += len(batch)
        self._stats["embedded_tokens_total"] += int(layout.lengths.sum())
        for row, item in enumerate(batch):
            self._store(pool_, item, rows[row], int(layout.lengths[row]))

    def _padded(
        self, backbone: Backbone, batch: list[Item], scoring: bool
    ) -> tuple[Layout, list[np.ndarray]]:
        """The MLX forward pass over a right-padded batch: each row's values."""
        layout = lay_out(batch)
        ids, mask = mx.array(layout.ids), mx.array(layout.mask)
        lengths = mx.array(layout.lengths)
        hidden = backbone.hidden(ids, mask, mx.array(layout.types))
        out = backbone.score(hidden, lengths) if scoring else hidden.astype(mx.float32)
        mx.eval(out)
        values = np.array(out)
        return layout, [values[row] for row in range(len(batch))]

    def _store(self, pool_: WaitingPool, item: Item, value: np.ndarray, length: int) -> None:
        pending = item.pending
        if pending.done:
            return
        if pending.job.mode == "embed":
            pending.result.vectors[item.index] = value[:length]
        else:
            pending.result.scores[item.index] = float(value)
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
        self._finished(pending)
