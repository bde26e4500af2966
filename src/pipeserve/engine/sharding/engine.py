"""ShardedEngine: MlxEngine whose model runs on a group of ranks (rank 0 is this engine).

The engine thread places and starts the group (group.py), loads rank 0's share (load.py)
and runs a Rank0Batch (lockstep.py). When the group is lost the model turns unhealthy
(`/health` 503, new requests get `unavailable`), requests in flight end with an error
event, and the process exits shortly after so that a fresh one places the model again
(an mx.distributed group cannot be re-initialised in a process). In a server that
process is the model's own shard host (server/remote/host.py, `--only`), which the
gunicorn master restarts; the workers and the other models keep serving.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from pipeserve.config.models import EngineOptions
from pipeserve.engine.mlx.engine import MlxEngine
from pipeserve.engine.mlx.scheduler import Scheduler
from pipeserve.engine.output.channel import Courier
from pipeserve.engine.sharding.group import RankGroup, group_joined
from pipeserve.engine.sharding.load import load_shard, weight_bytes
from pipeserve.engine.sharding.lockstep import Rank0Batch
from pipeserve.errors import ApiError
from pipeserve.gevent_support import os_sleep, start_os_thread

log = logging.getLogger("pipeserve.sharding")

EXIT_DELAY = 1.5  # seconds for the error events to reach the clients before the exit
RESCUE_AFTER = 1.0  # seconds the engine thread gets to fail its own requests after a loss


class ShardedEngine(MlxEngine):
    def __init__(
        self,
        name: str,
        model_dir: Path,
        tokenizer: Any,
        options: EngineOptions,
        exit_on_loss: bool = True,
        **kwargs: Any,
    ) -> None:
        if group_joined():
            # mx.distributed keeps one group per process and cannot join another.
            raise RuntimeError(
                f"model {name}: this process already ran a sharded group; a sharded model"
                " cannot be replaced in place (restart pipeserve)"
            )
        self.group = RankGroup(name, model_dir, options, self._on_lost)
        self.exit_on_loss = exit_on_loss
        self.shard_report: list[dict[str, Any]] = []
        self._batch: Rank0Batch | None = None
        super().__init__(
            name, lambda: self._start(model_dir, options), tokenizer, options, **kwargs
        )
        self._stats["shard_ranks"] = options.sharding.size if options.sharding else 1

    def _run(self) -> None:
        """A load that failed before this thread joined a group lets the thread end (it ran
        no MLX, so none of the thread-exit trouble MlxEngine._park avoids): a shard host
        retrying its placement keeps no thread per failed attempt."""
        self._serve()
        if self._load_error is None or group_joined():
            self._park()

    @property
    def healthy(self) -> bool:
        return self.group.healthy and super().healthy

    @property
    def health_reason(self) -> str:
        return self.group.reason or super().health_reason

    def _start(self, model_dir: Path, options: EngineOptions) -> Any:
        try:
            group = self.group.start()
            model = load_shard(model_dir, self.group.options, group)
            total, layers = weight_bytes(model)
            reports = self.group.wait_ready()
            self.shard_report = [{"rank": 0, "weight_bytes": total, "layer_weight_bytes": layers}]
            self.shard_report += reports
            mx.random.seed(self.group.begin())
            self._stats["shard_ranks"] = group.size()
        except BaseException:
            self.group.stop()
            raise
        log.info("model %s: sharded over %d ranks, peers %s; weights per rank %s", self.name,
                 len(self.shard_report), self.group.pids(), self.shard_report)  # fmt: skip
        return model

    def _new_batch(self, model: Any) -> Scheduler:
        self._batch = Rank0Batch(model, self.options, self._stats, self.group)
        return self._batch

    def _admit(self) -> None:
        if not self.group.healthy:
            raise ApiError("unavailable", f"model {self.name} is unavailable: {self.group.reason}")
        super()._admit()

    def stats(self) -> dict[str, float]:
        out = super().stats()
        out["shard_healthy"] = 1.0 if self.group.healthy else 0.0
        return out

    def _on_lost(self, reason: str) -> None:
        """From the watchdog or the engine thread: the group is gone for good."""
        self._inbox.put(("wake",))  # an idle engine thread notices nothing otherwise
        start_os_thread(self._after_loss, name=f"pipeserve-shard-lost-{self.name}")

    def _after_loss(self) -> None:
        os_sleep(RESCUE_AFTER)
        batch = self._batch
        if batch is not None and not batch.lost:
            self._rescue(batch)
        if self.exit_on_loss:
            os_sleep(EXIT_DELAY)
            self._exit_worker()

    def _rescue(self, batch: Rank0Batch) -> None:
        """The engine thread did not come back from its step: MLX does not always raise
        when a peer of a collective is gone (the error stays in its scheduler). End the
        requests from here; the engine thread stays stuck until the worker exits."""
        log.error("model %s: the engine thread is stuck in a collective; failing its requests",
                  self.name)  # fmt: skip
        batch.lost = True
        courier = Courier()
        message = f"sharded model failed: {self.group.reason}"
        for seq in list(batch.seqs.values()):
            seq.finish(courier, "error", message)
        while True:  # requests queued behind the stuck step
            try:
                item = self._inbox.get(block=False)
            except queue.Empty:
                break
            if item[0] == "submit":
                item[2].finish(courier, "error", message)
        courier.flush()

    def _exit_worker(self) -> None:
        log.error("model %s: exiting this process so that a new one restarts the group",
                  self.name)  # fmt: skip
        exit_process()


def stop_this_worker() -> None:
    """A gunicorn worker stops (gunicorn forks a fresh one, which starts a fresh group)."""
    os.kill(os.getpid(), signal.SIGTERM)


# How a process whose group was lost leaves, so that its supervisor starts a fresh one:
# the engine host (server.workers > 1) replaces it with its own exit (the master restarts it).
exit_process: Callable[[], None] = stop_this_worker
