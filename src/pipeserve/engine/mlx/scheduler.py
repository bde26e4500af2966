"""The scheduler: requests in, one planned step at a time, events out (engine thread only).

Each request is a `RequestState` keyed by the engine's own request key; the generator
(generator.py) knows it by its uid. A request joins with its own sampler, logits
processors, max tokens, stop (EOS) ids, a proposer when it speculates and, when the
prefix cache has one, the KV cache of its longest cached prefix. Each step the scheduler
plans what runs (`StepPlan`: how many waiting prompts join the prefill, whether logits
are normalised for logprobs) and hands the plan to the generator; the step's tokens go
to their requests' states, which post the events (output/request_state.py).
"""

from __future__ import annotations

import gc
import itertools
import logging
import random
import time
from functools import partial
from typing import Any

import mlx.core as mx
from mlx_lm.generate import StopSequences
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from pipeserve.config.models import EngineOptions, SpeculativeOptions
from pipeserve.engine.cpu_kernels import kernels
from pipeserve.engine.kv.prefix_cache import CacheLookup, PrefixCache
from pipeserve.engine.kv.quantized import RowCaches
from pipeserve.engine.mlx.generator import BatchGenerator
from pipeserve.engine.mlx.lora import rows_of
from pipeserve.engine.mlx.prompt_groups import Insert, PromptGroups
from pipeserve.engine.mlx.step_plan import StepPlan
from pipeserve.engine.output.channel import Courier
from pipeserve.engine.output.request_state import RequestState
from pipeserve.engine.sampling.constraints import ConstraintSet, SamplerFilters
from pipeserve.engine.sampling.samplers import make_processors, make_sampler
from pipeserve.engine.sampling.thinking_budget import BudgetTracker
from pipeserve.engine.speculative.draft import DraftProposer
from pipeserve.engine.speculative.proposer import RowProposer, stop_cutter
from pipeserve.engine.speculative.state import Speculation

log = logging.getLogger("pipeserve.engine")

DURATION_EMA = 0.2  # weight of the newest request in the mean request duration
WARMUP_PROMPT_TOKENS = 8


class Scheduler:
    """Owns the generator, the requests in it, the prefix cache and the speculation state."""

    def __init__(self, model: Any, options: EngineOptions, stats: dict[str, float]) -> None:
        self.model = model
        self.options = options
        self.stats = stats
        self.vocab_size: int | None = getattr(getattr(model, "args", None), "vocab_size", None)
        self.stream = mx.default_stream(mx.default_device())  # this (engine) thread's stream
        # Copies a batch's KV cache rows when rows finish (engine/kv/rows.py).
        self.cache_ops = kernels() if self.stream.device == mx.cpu else None
        self.prefix = PrefixCache(options.prefix_cache)
        self.lora = rows_of(model)  # the model's LoRA adapters (engine/mlx/lora.py), or None
        self.row_caches = RowCaches(model, options.kv_cache)  # a new row's (quantized) KV
        self.speculative = options.speculative or SpeculativeOptions(method="prompt_lookup")
        # A sharded model's ranks replay rank 0's steps: no speculation there (yet).
        self.speculation = (
            Speculation(self.speculative.max_batch, self.speculative.tokens_max + 1)
            if options.sharding is None
            else None
        )
        self.gen = self._new_generator()
        self._steps = 0
        self._fold_snapshots: list[tuple[int, int]] = []  # (uid, the step its prompt folded in)
        self.seqs: dict[int, RequestState] = {}
        self.uid_of: dict[int, int] = {}
        self.key_of: dict[int, int] = {}
        self._finished = 0
        self._stops: dict[frozenset[int], StopSequences] = {}
        self._constraints: ConstraintSet | None = None  # made at the first constrained job
        # Rows with a thinking budget (engine/sampling/thinking_budget.py), by request key.
        # A sharded model's ranks replay rank 0's steps: no forced tokens there (yet).
        self.budgets: dict[int, BudgetTracker] = {}
        # A request's n choices, prefilled once (engine/mlx/prompt_groups.py).
        # The lookup goes through self.prefix at each call: a sharded rank replaces it.
        self.groups = PromptGroups(self._fetch, options.sharding is None)
        for name in ("prompt_tokens_total", "cached_tokens_total", "completion_tokens_total", "decode_steps",
                     "requests_cancelled", "requests_failed", "engine_faults",
                     "speculative_proposed_tokens_total", "speculative_accepted_tokens_total",
                     "prefill_tokens_total", "shared_prompt_rows_total"):  # fmt: skip
            stats.setdefault(name, 0)
        self._update_stats()

    def use_draft(self, draft_model: Any) -> None:
        """Method draft: `draft_model` (loaded on this engine thread) proposes for the rows."""
        if self.speculation is not None:
            tokens, vocab = self.speculative.tokens, self.vocab_size
            self.speculation.draft = DraftProposer(draft_model, tokens, vocab)

    def _new_generator(self) -> Any:  # a BatchGenerator (mlx-lm's classes are untyped)
        return BatchGenerator(
            self.model,
            completion_batch_size=self.options.max_batch,
            prefill_batch_size=1,  # each step's plan sets it (from a token budget)
            prefill_step_size=self.options.prefill_step_size,
            stream=self.stream,
            speculation=self.speculation,
            cache_ops=self.cache_ops,
            lora=self.lora,
            # A sharded model's ranks replay rank 0's steps: no folded prompts there (yet).
            fold=self._may_fold if self.options.sharding is None else None,
        )

    def _may_fold(self, uid: int) -> bool:
        """Whether row `uid`'s last prompt token may run in its last prefill chunk
        (engine/mlx/prompt_fold.py): not a prompt group's, whose others wait for the
        leader's KV without that token."""
        key = self.key_of.get(uid)
        seq = self.seqs.get(key) if key is not None else None
        return seq is None or seq.job.prompt_group is None

    def warm_up(self) -> None:
        """Generate once at batch 1 and at max_batch, so the shapes the first requests use
        are compiled before they arrive (MLX's CUDA backend JIT-compiles per shape).

        Not for a sharded model: its ranks must run every step together, and a step on
        rank 0 alone would wait forever in the first collective."""
        if self.options.sharding is not None:
            return
        started = time.monotonic()
        try:
            for size in sorted({1, self.options.max_batch}):
                uids = self.gen.insert(
                    [[0] * WARMUP_PROMPT_TOKENS] * size,
                    max_tokens=[2] * size,
                    caches=[self.row_caches() for _ in range(size)],
                )
                pending = set(uids)
                while pending:
                    _, responses = self.gen.step(self._plan())
                    pending -= {r.uid for r in responses if r.finish_reason is not None}
        except Exception:
            log.warning(
                "warm-up failed; the first requests compile their own kernels", exc_info=True
            )
            self.gen.close()
            self.gen = self._new_generator()
            return
        # The finished warm-up batches' KV buffers sit in reference cycles of mlx-lm's
        # generator objects until Python's collector runs; with one op per layer a decode
        # step allocates few Python objects, so that could be many steps later.
        gc.collect()
        log.info(
            "warm-up at batch 1 and %d: %.2f s", self.options.max_batch, time.monotonic() - started
        )

    @property
    def idle(self) -> bool:
        return not self.seqs

    def add(self, key: int, seq: RequestState, courier: Courier) -> None:
        self.groups.add(self._inserter(courier), key, seq)

    def _fetch(self, tokens: list[int], adapter: str | None) -> CacheLookup:
        return self.prefix.fetch(tokens, adapter=adapter)

    def _inserter(self, courier: Courier) -> Insert:
        """_insert with this step's courier (for the prompt groups)."""
        return partial(self._insert, courier)

    def _insert(
        self, courier: Courier, key: int, seq: RequestState, lookup: CacheLookup, shared: bool
    ) -> None:
        """Add a job to the generator, from `lookup`'s KV (shared: a prompt group's copy)."""
        job = seq.job
        prompt = job.prompt_token_ids
        try:
            self._check_adapter(job.adapter)
            (uid,) = self.gen.insert(
                [list(lookup.rest)],
                max_tokens=[job.max_tokens],
                caches=[lookup.cache if lookup.cache is not None else self.row_caches()],
                all_tokens=[list(prompt[: lookup.cached_tokens])],
                samplers=[self._sampler(key, job)],
                logits_processors=[make_processors(job.sampling)],
                stop_sequences=[self._stop_sequences(job.stop_token_ids)],
            )
        except Exception as exc:
            log.exception("request %s rejected by the engine", job.request_id)
            if self._constraints is not None:
                self._constraints.release(key)
            seq.finish(courier, "error", f"engine rejected the request: {exc}")
            self._count_finished("requests_failed")
            self.groups.leader_gone(self._inserter(courier), key)
            return
        self.seqs[key], self.uid_of[key], self.key_of[uid] = seq, uid, key
        if self.lora is not None:
            self.lora.assign(uid, job.adapter)
        if job.thinking is not None and self.options.sharding is None:
            self.budgets[key] = BudgetTracker(job.thinking)
        self._speculate(uid, seq)
        seq.ready(courier, lookup.cached_tokens)
        self.stats["prompt_tokens_total"] += len(prompt)
        self.stats["cached_tokens_total"] += lookup.cached_tokens
        self.stats["prefill_tokens_total"] += len(lookup.rest)
        self.stats["shared_prompt_rows_total"] += shared
        self._update_stats()

    def _check_adapter(self, adapter: str | None) -> None:
        """A job's adapter is one this model loaded (the server checks names first)."""
        if adapter is None:
            return
        if self.lora is None or adapter not in self.lora.names:
            failed = self.lora.failed.get(adapter) if self.lora is not None else None
            raise ValueError(failed or f"adapter {adapter!r} is not loaded")
        self.lora.ensure(adapter)  # an on_demand adapter's matrices, at its first request

    def _speculate(self, uid: int, seq: RequestState) -> None:
        """Give the sequence a proposer when the model speculates or it has a prediction."""
        job = seq.job
        if self.speculation is None or not (self.options.speculative or job.prediction_token_ids):
            return
        if job.thinking is not None:  # forced tokens replace drawn ones: one token a step
            return
        method = self.options.speculative.method if self.options.speculative else None
        row = RowProposer(
            self.speculative,
            lookup=method == "prompt_lookup",
            drafted=method == "draft" and self.speculation.draft is not None,
            prediction=job.prediction_token_ids or None,
            stop_cut=stop_cutter(seq.tokenizer, job.stop_strings) if job.stop_strings else None,
        )
        self.speculation.proposers[uid] = seq.proposer = row

    def _sampler(self, key: int, job: Any) -> Any:
        sampler = make_sampler(job.sampling, self.vocab_size)
        if job.constraint is None:
            return sampler
        if self._constraints is None:
            self._constraints = ConstraintSet()
        params = job.sampling
        filters = SamplerFilters(
            normalize=0 < params.top_p < 1 or params.min_p > 0, subsets=params.top_k == 0
        )
        return self._constraints.wrap(key, job.constraint, sampler, filters)

    def _stop_sequences(self, ids: frozenset[int]) -> StopSequences:
        stops = self._stops.get(ids)
        if stops is None:
            stops = self._stops[ids] = StopSequences([[t] for t in sorted(ids)] or None)
        return stops

    def _plan(self) -> StepPlan:
        """The next step's plan: the prompts that join its prefill (_prefill_rows) and
        whether any row wants logprobs."""
        logprobs = any(seq.job.logprobs for seq in self.seqs.values())
        return StepPlan(prefill_rows=self._prefill_rows(), logprobs=logprobs)

    def _prefill_rows(self) -> int:
        """Let as many waiting prompts join the next prefill round as fit in
        options.prefill_tokens (at least one when none is being prefilled), at most
        options.prefill_batch: a burst of short prompts is prefilled in one round, so
        their first tokens come together and join the decode batch in one merge, while a
        burst of long prompts still stalls the running streams for a bounded time.

        Reads BatchGenerator's queue of waiting sequences (mlx-lm 0.32's private
        `_unprocessed_sequences`: uid, prompt segments, ...) and prompts in progress.
        """
        waiting = self.gen._unprocessed_sequences
        in_progress = self.gen._currently_processing  # [segments, done, total] each
        if not waiting:
            return max(1, len(in_progress))
        chunk = self.options.prefill_step_size
        # A prompt's last token is not prefilled: it is the input of its first decode step.
        left = [min(chunk, total - done - 1) for _, done, total in in_progress]
        budget = self.options.prefill_tokens - sum(left)
        busy = any(left)
        room = min(self.options.prefill_batch, self.options.max_batch) - len(in_progress)
        admitted = 0
        for entry in itertools.islice(waiting, max(0, room)):
            cost = min(chunk, sum(len(segment) for segment in entry[1]) - 1)
            if cost > budget and (admitted or busy):
                break
            budget -= cost
            admitted += 1
        return max(1, len(in_progress) + admitted)

    def step(self, courier: Courier) -> None:
        if self._constraints is not None:
            self._constraints.begin_step()
        try:
            self._steps += 1
            self._snapshot_folded()
            prompt_responses, responses = self.gen.step(self._plan())
            self._snapshot_prompts(prompt_responses)
            self._fold_snapshots += [(uid, self._steps) for uid in self.gen.folded_uids]
            self._share_prompts(prompt_responses, courier)
        except Exception as exc:
            log.exception(
                "engine step failed; failing the %d requests in the batch", len(self.seqs)
            )
            self.stats["engine_faults"] += 1
            self.fail_all(courier, f"engine fault: {type(exc).__name__}: {exc}")
            return
        self.stats["decode_steps"] += 1
        for response in responses:
            key = self.key_of.get(response.uid)
            if key is not None:
                self._deliver(key, response, courier)
        self._update_stats()

    def _share_prompts(self, responses: list[Any], courier: Courier) -> None:
        """Prompts now in their KV cache (all but their last token): a prompt group's
        leader shares it with the group's waiting jobs."""
        for response in responses:
            key = self.key_of.get(response.uid)
            if key is None or not response.end_of_segment or response.end_of_prompt:
                continue
            self.groups.prompt_prefilled(
                self._inserter(courier),
                key,
                self.seqs[key].job.prompt_group,
                partial(self._prompt_cache, response.uid),
            )

    def _prompt_cache(self, uid: int) -> Any:
        """The KV cache of row `uid`'s processed tokens (a copy out of the batch)."""
        ((cache, _),) = self.gen.extract_cache([uid]).values()
        return cache

    def _snapshot_prompts(self, responses: list[Any]) -> None:
        """Cache the KV state of each prompt (minus its last token) once it is prefilled.

        A repeated or extended prompt then hits it without trimming, which caches with
        a sliding window (RotatingKVCache) cannot do once they have wrapped.
        """
        if not self.prefix.enabled:
            return
        uids = [
            r.uid
            for r in responses
            if r.end_of_segment and not r.end_of_prompt and r.uid in self.key_of
        ]
        if uids:
            for uid, (cache, tokens) in self.gen.extract_cache(uids).items():
                adapter = self.seqs[self.key_of[uid]].job.adapter
                self.prefix.store(list(tokens), cache, kind="user", adapter=adapter)

    def _snapshot_folded(self) -> None:
        """As `_snapshot_prompts`, for rows whose last prompt token folded into their
        prefill (engine/mlx/prompt_fold.py), two steps later: their first token went out
        in the step after the fold, before this copy of the row's KV cache (trimmed to
        all but the last prompt token) is made. A row that ended meanwhile stored its
        whole KV cache already."""
        if not self._fold_snapshots:  # every step: nothing to do but for folded prompts
            return
        due = [uid for uid, at in self._fold_snapshots if at < self._steps - 1]
        self._fold_snapshots = [
            (uid, at) for uid, at in self._fold_snapshots if at >= self._steps - 1
        ]
        uids = [uid for uid in due if uid in self.key_of]
        if not self.prefix.enabled or not uids:
            return
        for uid, (cache, tokens) in self.gen.extract_cache(uids).items():
            job = self.seqs[self.key_of[uid]].job
            keep = len(job.prompt_token_ids) - 1
            extra = len(tokens) - keep
            if extra < 1 or list(tokens[:keep]) != job.prompt_token_ids[:keep]:
                continue  # not the folded row's KV (never expected)
            trimmed: Any = can_trim_prompt_cache(cache) and trim_prompt_cache(cache, extra)
            if trimmed == extra:  # mlx-lm returns the number of tokens trimmed
                self.prefix.store(list(tokens[:keep]), cache, kind="user", adapter=job.adapter)

    def _deliver(self, key: int, response: Any, courier: Courier) -> None:
        seq = self.seqs[key]
        reason = response.finish_reason
        try:
            if reason == "stop":
                seq.stop_token(courier)
            else:
                seq.token(courier, response.token, response.logprobs, final=reason == "length")
                self.stats["completion_tokens_total"] += 1
                if reason is None and key in self.budgets:
                    self._spend_thinking(key, response)
        except Exception as exc:
            log.exception("request %s: token delivery failed", seq.job.request_id)
            if reason is None:
                self.gen.remove([self.uid_of[key]])
            self._forget(key)
            seq.finish(courier, "error", f"engine fault: {type(exc).__name__}: {exc}")
            self._count_finished("requests_failed")
            return
        if reason is not None:
            self._forget(key)
            if response.all_tokens is not None and response.prompt_cache is not None:
                self.prefix.store(
                    response.all_tokens[:], response.prompt_cache, adapter=seq.job.adapter
                )
            seq.finish(courier, reason)
            self._count_finished()
            self._observe_duration(time.monotonic() - seq.submitted_at)

    def _spend_thinking(self, key: int, response: Any) -> None:
        """Count the token against the row's thinking budget; once it is spent, the
        close of the think block becomes the row's next tokens."""
        tracker = self.budgets[key]
        forced = tracker.after(response.token)
        if forced is not None and not self.gen.force_next(response.uid, forced):
            tracker.state = "done"  # the row is not decoding (it just ended)
        if tracker.done:
            del self.budgets[key]

    def cancel(self, key: int, courier: Courier) -> None:
        held = self.groups.take_held(key)
        if held is not None:  # waiting for its leader's prompt: not in the generator
            held.finish(courier, "cancelled")
            self._count_finished("requests_cancelled")
            return
        seq = self.seqs.get(key)
        if seq is None:
            return
        self.groups.leader_gone(self._inserter(courier), key)
        uid = self.uid_of[key]
        # Keep the KV state of a sequence that is decoding: agents often resend it.
        keep = seq.completion_tokens > 0 and self.prefix.enabled
        caches = self.gen.remove([uid], return_prompt_caches=keep)
        if uid in caches:
            cache, tokens = caches[uid]
            self.prefix.store(list(tokens), cache, adapter=seq.job.adapter)
        self._forget(key)
        seq.finish(courier, "cancelled")
        self._count_finished("requests_cancelled")
        self._update_stats()

    def _forget(self, key: int) -> None:
        if self._constraints is not None:
            self._constraints.release(key)
        self.budgets.pop(key, None)
        self.groups.forget(key)
        seq = self.seqs.pop(key, None)
        uid = self.uid_of.pop(key, None)
        if uid is not None:
            self.key_of.pop(uid, None)
            if self.lora is not None:
                self.lora.forget(uid)
            if self.speculation is not None:
                self.speculation.proposers.pop(uid, None)
                if not self.seqs:  # idle: nothing keeps the draft's cache alive
                    self.speculation.clear()
        if seq is not None and seq.proposer is not None:
            self.stats["speculative_proposed_tokens_total"] += seq.proposer.proposed
            self.stats["speculative_accepted_tokens_total"] += seq.proposer.accepted

    def _observe_duration(self, seconds: float) -> None:
        """Moving average of how long a completed request took (for Retry-After)."""
        mean = self.stats.get("mean_request_seconds")
        self.stats["mean_request_seconds"] = (
            seconds if not mean else mean + DURATION_EMA * (seconds - mean)
        )

    def _count_finished(self, counter: str | None = None) -> None:
        self._finished += 1
        if counter:
            self.stats[counter] += 1

    def reap(self) -> int:
        """How many requests ended since the last call (their slots are free)."""
        finished, self._finished = self._finished, 0
        return finished

    def fail_all(self, courier: Courier, message: str) -> None:
        for seq in [*self.seqs.values(), *self.groups.drain()]:
            seq.finish(courier, "error", message)
            self._count_finished("requests_failed")
        self.seqs.clear()
        self.uid_of.clear()
        self.key_of.clear()
        self.budgets.clear()
        if self.lora is not None:
            self.lora.slot_of.clear()
        if self.speculation is not None:
            self.speculation.clear()
        if self._constraints is not None:
            self._constraints.clear()
        self.gen.close()
        self.gen = self._new_generator()  # its state may be inconsistent after a fault
        self._fold_snapshots = []  # the new generator numbers its rows anew
        # A fault inside a compiled sampler can leave a tracer as the global key.
        mx.random.seed(random.getrandbits(32))
        self._update_stats()

    def close(self, courier: Courier) -> None:
        for seq in [*self.seqs.values(), *self.groups.drain()]:
            seq.finish(courier, "error", "the model is shutting down")
        self.seqs.clear()
        self.gen.close()

    def _update_stats(self) -> None:
        self.stats["prefix_cache_hits"] = self.prefix.hits
        self.stats["prefix_cache_misses"] = self.prefix.misses
        self.stats["prefix_cache_bytes"] = self.prefix.nbytes
        self.stats["prefix_cache_entries"] = len(self.prefix)
        self.stats["constrained_sequences"] = (
            len(self._constraints.rows) if self._constraints else 0
        )
