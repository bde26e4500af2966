"""MlxEngine: one OS thread per model runs mlx-lm's BatchGenerator (continuous batching).

Requests (and cancellations) reach the engine thread through an inbox that blocks the
OS thread, never the gevent hub. Each loop turn the thread applies every pending
message (a new request joins the running batch, a cancelled one leaves it at once),
runs one BatchGenerator step (a decode step plus, when there is room, a prefill
chunk) and hands the step's events to the waiting requests in one delivery per hub.
The model is loaded on the engine thread: MLX arrays and streams belong to the
thread that made them (docs/architecture.md, "Threading model").
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

from pipeserve.backend import describe_device
from pipeserve.config.models import EngineOptions
from pipeserve.engine.base import GenerationJob
from pipeserve.engine.mlx.engine_thread import MAX_RETRY_AFTER, RETRY_AFTER_SECONDS, EngineThread
from pipeserve.engine.mlx.scheduler import Scheduler
from pipeserve.engine.output.channel import Channel, Courier
from pipeserve.engine.output.detokenize import Detokenizers
from pipeserve.engine.output.request_state import RequestState
from pipeserve.engine.output.stream import EngineStream
from pipeserve.engine.weights.memory import release_free_memory
from pipeserve.errors import ApiError
from pipeserve.gevent_support import OsThreadHost

log = logging.getLogger("pipeserve.engine")


class MlxEngine(EngineThread[tuple[Scheduler, Courier]]):
    """Engine for a loaded mlx-lm model; `submit` is safe from any thread or greenlet.

    Unhealthy while one step has run longer than options.stall_seconds: a wedged step
    (a hung device, a lost peer) would otherwise leave /health saying ok forever.
    """

    accepts_mock_response = False

    def __init__(
        self,
        name: str,
        load_model: Callable[[], Any],
        tokenizer: Any,
        options: EngineOptions | None = None,
        host: OsThreadHost | None = None,
        load_draft: Callable[[], Any] | None = None,
    ) -> None:
        super().__init__(name, options or EngineOptions())
        self.tokenizer = tokenizer
        self.max_tokens_limit = self.options.max_tokens_limit
        self._detokenizers = Detokenizers(tokenizer)
        self._adapter_failures: dict[str, str] = {}  # set at load (engine/mlx/lora.py)
        self._step_started: float | None = None  # monotonic start of the running step
        self._load_model = load_model
        self._load_draft = load_draft  # method draft: its weights, on the engine thread too
        self._launch(host, f"pipeserve-engine-{name}")
        # Stop decoding before interpreter shutdown tears down what the thread uses.
        atexit.register(_close_at_exit, weakref.ref(self))

    # -- request side (any thread / greenlet) ------------------------------------

    def submit(self, job: GenerationJob) -> EngineStream:
        self._check_adapter(job.adapter)
        self._admit()
        key = next(self._keys)
        channel = Channel()
        sequence = RequestState(job, channel, self._detokenizers.new(), self.tokenizer)
        stream = EngineStream(
            channel, lambda: self._inbox.put(("cancel", key)), job.keepalive_interval
        )
        self._inbox.put(("submit", key, sequence))
        return stream

    def _check_adapter(self, adapter: str | None) -> None:
        """A job for an adapter that failed to load: 503 with its reason (the base and
        the other adapters serve)."""
        reason = self._adapter_failures.get(adapter) if adapter is not None else None
        if reason is not None:
            raise ApiError(
                "unavailable",
                f"model {self.name}: adapter {adapter!r} is not loaded: {reason}",
                param="model",
            )

    def describe(self) -> dict[str, Any]:
        """The LoRA adapters this model refused at load, with their reasons (if any)."""
        return {"adapter_errors": dict(self._adapter_failures)} if self._adapter_failures else {}

    def _retry_after(self) -> float:
        """About when a place frees up: with max_batch running, one ends every mean/max_batch s."""
        mean = float(self._stats.get("mean_request_seconds") or RETRY_AFTER_SECONDS)
        return min(MAX_RETRY_AFTER, max(RETRY_AFTER_SECONDS, mean / self.options.max_batch))

    def stats(self) -> dict[str, float]:
        """Live counters for metrics: queue depth, active sequences, cache hits, tokens.

        A request counts from submit to its Usage: the first max_batch are active (in
        the batch, or joining it at the next step), the rest wait in the queue.
        """
        out = dict(self._stats)
        in_flight = self._in_flight
        out["in_flight"] = in_flight
        out["active_sequences"] = min(in_flight, self.options.max_batch)
        out["queue_depth"] = in_flight - out["active_sequences"]
        return out

    @property
    def healthy(self) -> bool:
        return self._stalled_seconds() is None

    @property
    def health_reason(self) -> str:
        stalled = self._stalled_seconds()
        if stalled is None:
            return ""
        return (
            f"an engine step has been running for {stalled:.0f} s (stall_seconds:"
            f" {self.options.stall_seconds:g}): the model may be stuck"
        )

    def _stalled_seconds(self) -> float | None:
        started = self._step_started
        running = 0.0 if started is None else time.monotonic() - started
        return running if running > self.options.stall_seconds else None

    # -- engine thread ------------------------------------------------------------

    def _open(self) -> tuple[Scheduler, Courier]:
        batch = self._new_batch(self._load_model())
        if self._load_draft is not None:
            batch.use_draft(self._load_draft())
        self._load_model = self._load_draft = lambda: None  # drop the loader closures
        if batch.lora is not None:
            self._adapter_failures = dict(batch.lora.failed)
        log.info("model %s: runs on %s", self.name, describe_device())
        if self.options.warmup:
            batch.warm_up()
        release_free_memory()  # the load's and the warm-up's garbage (engine/weights/memory.py)
        return batch, Courier()

    def _shut(self, state: tuple[Scheduler, Courier]) -> None:
        batch, courier = state
        batch.close(courier)
        courier.flush()

    def _new_batch(self, model: Any) -> Scheduler:
        return Scheduler(model, self.options, self._stats)

    def _loop(self, state: tuple[Scheduler, Courier]) -> None:
        batch, courier = state
        running = True
        while running:
            try:
                running = self._drain(state, block=batch.idle)
                if running and not batch.idle:
                    self._step_started = time.monotonic()
                    batch.step(courier)
            except Exception as exc:  # a bug must not kill the engine thread
                log.exception("engine loop failed; failing the requests in the batch")
                batch.fail_all(courier, f"engine fault: {type(exc).__name__}: {exc}")
            self._step_started = None
            for _ in range(batch.reap()):
                self._release()
            courier.flush()

    def _handle(self, state: tuple[Scheduler, Courier], message: tuple[Any, ...]) -> None:
        batch, courier = state
        if message[0] == "submit":
            batch.add(message[1], message[2], courier)
        elif message[0] == "cancel":
            batch.cancel(message[1], courier)


def _close_at_exit(ref: weakref.ref[MlxEngine]) -> None:
    engine = ref()
    if engine is not None:
        engine.close(timeout=5.0)
