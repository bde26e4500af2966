"""ReplayEngine: streams a scripted raw completion as if a model generated it.

For client integration tests without a model. The script (the job's mock_completion,
else the model's YAML `replay.completion`) is tokenized with the model's real
tokenizer (added special tokens such as Harmony's `<|channel|>` stay single tokens)
and emitted token by token through the same detokenizer, delivery channel and event
contract as the MLX engine: PromptReady, TokenText..., Finish, Usage. A thinking budget
rewrites the script as a budgeted model would write it. An EOS token in
the script ends it ("stop"; not emitted, counted); max_tokens ends it with "length".
No weights are loaded. One OS thread serves all replays of a model, interleaving
them by due time, so a per-token delay never blocks the gevent hub.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import time
from dataclasses import dataclass, field
from typing import Any

from pipeserve.engine.base import AlwaysHealthy, GenerationJob
from pipeserve.engine.output.channel import Channel, Courier
from pipeserve.engine.output.detokenize import Detokenizers
from pipeserve.engine.output.request_state import RequestState
from pipeserve.engine.output.stream import EngineStream
from pipeserve.engine.sampling.thinking_budget import budgeted_script
from pipeserve.errors import ApiError
from pipeserve.gevent_support import os_lock, os_simple_queue, start_os_thread

log = logging.getLogger("pipeserve.engine")

BURST = 32  # tokens per job per loop turn when there is no delay


@dataclass
class _Replay:
    seq: RequestState
    tokens: list[int]
    position: int = 0
    stop_at: int | None = None  # index of the first EOS token in `tokens`
    due: float = 0.0
    key: int = field(default=0)


class ReplayEngine(AlwaysHealthy):
    accepts_mock_response = True

    def __init__(
        self,
        name: str,
        tokenizer: Any,
        eos_token_ids: frozenset[int],
        default_completion: str = "",
        delay: float = 0.0,
        capacity: int = 1024,
    ) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.default_completion = default_completion
        self.delay = delay
        self.max_tokens_limit: int | None = None
        self._capacity = capacity
        self._detokenizers = Detokenizers(tokenizer)
        self._inbox = os_simple_queue()
        self._lock = os_lock()
        self._in_flight = 0
        self._keys = itertools.count(1)
        self._stats: dict[str, float] = {
            "requests_total": 0,
            "completion_tokens_total": 0,
            "queue_depth": 0,
        }
        start_os_thread(self._run, name=f"pipeserve-replay-{name}")

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def submit(self, job: GenerationJob) -> EngineStream:
        completion = (
            job.mock_completion if job.mock_completion is not None else self.default_completion
        )
        tokens = self.tokenize(completion)
        if job.thinking is not None:  # as a budgeted model would write it
            tokens = budgeted_script(tokens, job.thinking)
        stops = job.stop_token_ids or self.eos_token_ids
        stop_at = next((i for i, t in enumerate(tokens) if t in stops), None)
        with self._lock:
            if self._in_flight >= self._capacity:
                raise ApiError(
                    "overloaded", f"model {self.name} is at capacity; retry later", retry_after=1.0
                )
            self._in_flight += 1
            self._stats["requests_total"] += 1
        key = next(self._keys)
        channel = Channel()
        seq = RequestState(job, channel, self._detokenizers.new(), self.tokenizer)
        replay = _Replay(seq, tokens, stop_at=stop_at, key=key)
        self._inbox.put(("submit", replay))
        return EngineStream(
            channel, lambda: self._inbox.put(("cancel", key)), job.keepalive_interval
        )

    def stats(self) -> dict[str, float]:
        out = dict(self._stats)
        out["active_sequences"] = self._in_flight
        return out

    def close(self) -> None:
        self._inbox.put(("close",))

    # -- engine thread ------------------------------------------------------------

    def _run(self) -> None:
        active: dict[int, _Replay] = {}
        due: list[tuple[float, int]] = []
        courier = Courier()
        running = True
        while running:
            try:
                timeout = None if not due else max(0.0, due[0][0] - time.monotonic())
                running = self._drain(active, due, courier, timeout)
                self._advance_due(active, due, courier)
            except Exception as exc:  # a bug must not kill the engine thread
                log.exception("replay loop failed; failing its requests")
                for replay in active.values():
                    replay.seq.finish(
                        courier, "error", f"engine fault: {type(exc).__name__}: {exc}"
                    )
                    self._release()
                active.clear()
                due.clear()
            courier.flush()
        for replay in active.values():
            replay.seq.finish(courier, "error", "the model is shutting down")
        courier.flush()

    def _advance_due(
        self, active: dict[int, _Replay], due: list[tuple[float, int]], courier: Courier
    ) -> None:
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, key = heapq.heappop(due)
            replay = active.get(key)
            if replay is not None and self._advance(replay, courier):
                replay.due = now + self.delay
                heapq.heappush(due, (replay.due, key))
            elif replay is not None:
                del active[key]

    def _drain(self, active: dict[int, _Replay], due: list[tuple[float, int]], courier: Courier,
               timeout: float | None) -> bool:  # fmt: skip
        block = True
        while True:
            try:
                message = (
                    self._inbox.get(timeout=timeout) if block else self._inbox.get(block=False)
                )
            except queue.Empty:
                return True
            block = False
            if message[0] == "submit":
                replay = message[1]
                active[replay.key] = replay
                replay.seq.ready(courier)
                heapq.heappush(due, (time.monotonic(), replay.key))
            elif message[0] == "cancel":
                replay = active.pop(message[1], None)
                if replay is not None:
                    self._end(replay, courier, "cancelled")
            else:
                return False

    def _advance(self, replay: _Replay, courier: Courier) -> bool:
        """Emit the next token(s); False when the replay has ended."""
        seq, job = replay.seq, replay.seq.job
        end = replay.stop_at if replay.stop_at is not None else len(replay.tokens)
        for _ in range(1 if self.delay > 0 else BURST):
            if seq.completion_tokens >= job.max_tokens:
                self._end(replay, courier, "length")
                return False
            if replay.position >= end:
                if replay.stop_at is not None:
                    seq.stop_token(courier)
                self._end(replay, courier, "stop")
                return False
            token = replay.tokens[replay.position]
            replay.position += 1
            script_done = replay.position >= end and replay.stop_at is None
            seq.token(
                courier, token, final=script_done or seq.completion_tokens + 1 >= job.max_tokens
            )
            self._stats["completion_tokens_total"] += 1
        return True

    def _end(self, replay: _Replay, courier: Courier, reason: Any) -> None:
        replay.seq.finish(courier, reason)
        self._release()

    def _release(self) -> None:
        with self._lock:
            self._in_flight -= 1
