"""The batch in lockstep on every rank: rank 0 decides, the other ranks replay.

Every rank runs the same `Scheduler` (mlx/scheduler.py, over mlx-lm's BatchGenerator) on its engine thread's one
MLX stream, so the model's collectives are issued in the same order everywhere. The
batch may change only through the log rank 0 sends before each step: a new request
with its prompt token ids and a resolved sampling seed, a cancel, a removal after a
delivery fault. Rank 0 detokenises and emits events; the other ranks drop them
(`PeerSequence`). A step counter in every message is checked on every rank.

Structured output: every rank samples for itself, so every rank masks for itself. A
request's grammar travels as text with its submit (a matcher cannot be pickled) and each
rank compiles its own matcher from it with the same tokenizer; as every rank samples the
same tokens, the matchers advance alike and the masks stay equal.

The prefix cache: every rank stores the same token sequences at the same points (the
same batch, the same steps), so lookups agree as long as evictions do. Byte-bounded
eviction would not (ranks hold different layer counts), so the ranks' caches evict
nothing by themselves: after each step rank 0 measures its own (scaled to the whole
model's KV bytes) and logs `("prefix", "trim", count)`, which every rank applies in the
same LRU order. A delivery fault on rank 0 (which skips that request's store there)
clears every rank's cache at the end of the step. Each submit carries rank 0's cached
length; a rank that finds another breaks the group rather than decode out of step.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from typing import Any

from pipeserve.config.models import EngineOptions
from pipeserve.engine.base import GenerationJob
from pipeserve.engine.kv.prefix_cache import PrefixCache
from pipeserve.engine.mlx.scheduler import Scheduler
from pipeserve.engine.output.channel import Courier
from pipeserve.engine.output.request_state import RequestState
from pipeserve.engine.sampling.samplers import make_sampler
from pipeserve.engine.sharding.group import GroupLost, RankGroup

log = logging.getLogger("pipeserve.sharding")


class LockstepBatch(Scheduler):
    """What every rank's batch shares: a prefix cache that only trims when told."""

    def __init__(self, model: Any, options: EngineOptions, stats: dict[str, float]) -> None:
        super().__init__(model, options, stats)
        self.prefix = PrefixCache(options.prefix_cache, bounded=False)

    def apply_prefix(self, change: tuple[Any, ...]) -> None:
        if change[1] == "trim":
            self.prefix.trim_to_count(int(change[2]))
        elif change[1] == "clear":
            self.prefix.clear()
        else:
            raise ProtocolError(f"unknown prefix cache change {change[1]!r}")


def kv_scale(model: Any, sharding: Any) -> float:
    """Whole-model KV bytes per byte of rank 0's KV cache."""
    if sharding.strategy == "tensor":
        return float(sharding.size)
    total = getattr(getattr(model, "args", None), "num_hidden_layers", None)
    local = len(getattr(model, "layers", ()) or ())
    return total / local if isinstance(total, int) and local else float(sharding.size)


def resolve_seed(job: GenerationJob, vocab_size: int | None) -> None:
    """Draw on rank 0 the seed a sampler would draw for itself, so all ranks sample alike."""
    if job.sampling.seed is not None:
        return
    try:
        if make_sampler(job.sampling, vocab_size) is make_sampler(job.sampling, vocab_size):
            return  # greedy or one shared sampler: no seed of its own
    except ValueError:
        return  # invalid parameters: every rank's Scheduler.add rejects the request alike
    job.sampling = dataclasses.replace(job.sampling, seed=random.getrandbits(63))


ConstraintSpec = tuple[str, str, bool]  # grammar, forced text, optional


def outbound(job: GenerationJob) -> tuple[GenerationJob, ConstraintSpec | None]:
    """The job as the other ranks get it: its constraint as text (see the module doc)."""
    constraint = job.constraint
    if constraint is None:
        return job, None
    spec = (constraint.grammar, constraint.forced, constraint.optional)
    return dataclasses.replace(job, constraint=None), spec


class Rank0Batch(LockstepBatch):
    """Rank 0's batch: applies each change locally and logs it for the next step."""

    def __init__(self, model: Any, options: EngineOptions, stats: dict[str, float],
                 group: RankGroup) -> None:  # fmt: skip
        super().__init__(model, options, stats)
        self.group = group
        self.steps = 0
        self.lost = False
        self._log: list[tuple[Any, ...]] = []
        self._kv_scale = kv_scale(model, group.sharding)
        self._prefix_fault = False

    def add(self, key: int, seq: RequestState, courier: Courier) -> None:
        if self.lost:
            seq.finish(courier, "error", f"model unavailable: {self.group.reason}")
            self._count_finished("requests_failed")
            return
        resolve_seed(seq.job, self.vocab_size)
        job, spec = outbound(seq.job)
        super().add(key, seq, courier)
        self._log.append(("submit", key, job, spec, seq.cached_tokens))

    def cancel(self, key: int, courier: Courier) -> None:
        if key in self.seqs:
            self._log.append(("cancel", key))
        super().cancel(key, courier)

    def _deliver(self, key: int, response: Any, courier: Courier) -> None:
        failed_before = self.stats.get("requests_failed", 0)
        super()._deliver(key, response, courier)
        if self.stats.get("requests_failed", 0) != failed_before:
            self._prefix_fault = True  # this rank skipped a store the others make
        if response.finish_reason is None and key not in self.seqs:
            self._log.append(("cancel", key))  # removed after a delivery fault

    def _after_step(self) -> None:
        """The prefix cache's changes of this step, for every rank (module doc)."""
        if self._prefix_fault:
            self._prefix_fault = False
            self.prefix.clear()
            self._log.append(("prefix", "clear"))
        budget = self.options.prefix_cache.max_bytes
        count = self.prefix.trim_to_bytes(budget, self._kv_scale)
        if count is not None:
            self._log.append(("prefix", "trim", count))

    def step(self, courier: Courier) -> None:
        if self.lost:
            return
        self.steps += 1
        try:
            self.group.broadcast(("step", self.steps, self._log))
        except GroupLost as exc:
            self.fail_all(courier, str(exc))
            return
        self._log = []
        self.group.step_started = time.monotonic()
        try:
            super().step(courier)
        finally:
            self.group.step_started = None
        self._after_step()

    def fail_all(self, courier: Courier, message: str) -> None:
        """Any fault breaks lockstep: end every request and give the group up."""
        self.lost = True
        reason = self.group.reason if not self.group.healthy and self.group.reason else message
        for seq in self.seqs.values():
            seq.finish(courier, "error", f"sharded model failed: {reason}")
            self._count_finished("requests_failed")
        self.seqs.clear()
        self.uid_of.clear()
        self.key_of.clear()
        self._update_stats()
        self.group.lose(message)

    def close(self, courier: Courier) -> None:
        for seq in self.seqs.values():
            seq.finish(courier, "error", "the model is shutting down")
        self.seqs.clear()
        self.group.stop()


class PeerSequence:
    """A request on a rank other than 0: the engine's RequestState without events."""

    def __init__(self, job: GenerationJob, cached_on_rank0: int | None = None) -> None:
        self.job = job
        self.completion_tokens = 0
        self.submitted_at = time.monotonic()
        self.cached_on_rank0 = cached_on_rank0
        self.proposer: Any = None  # the batch reads it; ranks never speculate

    def ready(self, courier: Any, cached_tokens: int = 0) -> None:
        expected = self.cached_on_rank0
        if expected is not None and cached_tokens != expected:
            raise ProtocolError(
                f"prefix cache out of step: rank 0 reused {expected} tokens, this rank"
                f" {cached_tokens}"
            )

    def token(self, courier: Any, token_id: int, logprobs: Any = None, final: bool = False) -> None:
        self.completion_tokens += 1

    def stop_token(self, courier: Any) -> None:
        self.completion_tokens += 1

    def finish(self, courier: Any, reason: str, error: str | None = None) -> None:
        pass


class PeerBatch(LockstepBatch):
    """The batch of a rank other than 0: a fault ends the rank (rank 0 sees it)."""

    def __init__(self, model: Any, options: EngineOptions, grammar: Any = None) -> None:
        super().__init__(model, options, {})
        self.grammar = grammar  # a GrammarCompiler for this model's tokenizer

    def constrained(self, job: GenerationJob, spec: ConstraintSpec | None) -> GenerationJob:
        """The job with its own matcher, compiled here from rank 0's grammar text."""
        if spec is None:
            return job
        if self.grammar is None:
            raise ProtocolError("a constrained request, but this rank has no grammar compiler")
        return dataclasses.replace(job, constraint=self.grammar.constraint(*spec))

    def fail_all(self, courier: Any, message: str) -> None:
        raise GroupLost(message)


class ProtocolError(RuntimeError):
    """A rank got a message it cannot follow (out of step, unknown kind)."""


def replay(batch: Scheduler, message: tuple[Any, ...], expected_step: int) -> bool:
    """Apply one message from rank 0 on another rank; False when the group closes."""
    kind = message[0]
    if kind == "close":
        return False
    if kind != "step":
        raise ProtocolError(f"unknown control message {kind!r}")
    _, step, changes = message
    if step != expected_step:
        raise ProtocolError(f"rank 0 is at step {step}, this rank at {expected_step}")
    for change in changes:
        if change[0] == "submit":
            _, key, job, spec, cached = change
            if isinstance(batch, PeerBatch):
                job = batch.constrained(job, spec)
            batch.add(key, PeerSequence(job, cached), None)  # type: ignore[arg-type]
        elif change[0] == "cancel":
            batch.cancel(change[1], None)  # type: ignore[arg-type]
        elif change[0] == "prefix" and isinstance(batch, LockstepBatch):
            batch.apply_prefix(change)
        else:
            raise ProtocolError(f"unknown batch change {change[0]!r}")
    batch.step(None)  # type: ignore[arg-type]
    return True
