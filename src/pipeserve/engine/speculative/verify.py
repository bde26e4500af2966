"""Speculative decoding inside mlx-lm's batched decode step (engine thread only).

A step where some rows have proposals (engine/speculative/proposer.py) feeds every row its next
token followed by its proposal, padded to the longest one: one forward pass of
B x (K+1) tokens. Each row then samples position after position with its own sampler
and logits processors (sample-and-match, as mlx-lm's speculative_generate_step): the
proposal's token j is accepted while the token sampled at position j equals it; the
first sampled token that differs (or the one after the whole proposal) becomes the
row's next token. Every emitted token is the one the model would have sampled with the
same state, so greedy output is token for token the same and sampled output keeps its
distribution; a seeded sampler is called exactly once per emitted token, as without
speculation. Constrained rows advance their grammar matcher only along accepted tokens.

KV rollback keeps mlx-lm's BatchKVCache layout (rows left-padded to one shared end):
after the pass row i holds r_i = K - accepted_i positions it must forget. All rows are
trimmed by min(r); a row with more to forget is rolled right by the difference, its
left padding growing by as much (the same roll mlx-lm uses to finalize right-padded
prompts). Exact, and every other cache operation (filter, extend, extract, the prefix
cache) stays mlx-lm's own; the price is a copy of the KV rows that roll, measured in
docs/speculative.md. Caches that cannot be rolled this way (sliding windows, recurrent
state) are not speculated on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache
from mlx_lm.sample_utils import greedy_sampler

from pipeserve.engine.kv.quantized import BatchQuantizedKVCache
from pipeserve.engine.kv.rows import trim_rows
from pipeserve.engine.sampling.constraints import RowConstraint
from pipeserve.engine.speculative.policy import choose_width
from pipeserve.engine.speculative.proposer import RowProposer
from pipeserve.engine.speculative.state import Speculation


@dataclass(slots=True)
class RowOutcome:
    emitted: list[int]  # the row's next token, then its accepted proposal tokens
    logprobs: list[Any]  # one per emitted token (None when nobody asked)
    next_token: int
    next_logprobs: Any


def rollable(cache: list[Any]) -> bool:
    return bool(cache) and all(type(c) in (BatchKVCache, BatchQuantizedKVCache) for c in cache)


def speculative_next(batch: Any, spec: Speculation) -> list[Any] | None:
    """mlx-lm's GenerationBatch.next() with proposals verified; None when this step does
    not verify (the caller takes the ordinary step). engine/speculative/policy.py chooses the
    tokens per row from the rows' acceptance and the measured step costs: first without
    waiting for the batch's next tokens (a batch where nothing can pay keeps its
    pipelined ordinary steps), then with the actual proposals."""
    count = len(batch.uids)
    if spec.max_rows is not None and count > spec.max_rows:
        return None
    if not rollable(batch.prompt_cache):
        return None
    rows = [spec.proposers.get(uid) for uid in batch.uids]
    rows = [row if row is not None and row.ready() else None for row in rows]
    # A row whose acceptance is unknown verifies once (its estimate is the prior until
    # then, and the batch's costs are learnt), but only where a proposal accepted whole
    # would pay at this batch size's costs: at a batch where verifying never pays, a new
    # row's first check would only slow every row down.
    exploring = any(row is not None and not row.acceptance.known for row in rows)
    if not exploring and not spec.costs.measured(count, 1):
        return None  # an ordinary step of this batch size is timed first
    offers = [
        (_hoped(row), row.reach if row.may_propose(batch.tokens[i]) else 0) if row else (0.0, 0)
        for i, row in enumerate(rows)
    ]
    if choose_width(offers, spec.costs, spec.widest) == 1:
        _skipped(rows)
        return None  # without waiting for the next tokens: the ordinary step overlaps
    mx.eval(batch._next_tokens)
    started = time.perf_counter()
    inputs: list[int] = batch._next_tokens.tolist()
    drafted: list[list[int]] = [[] for _ in rows]
    if spec.draft is not None:
        histories = [tokens + [t] for tokens, t in zip(batch.tokens, inputs)]
        drafted = spec.draft.propose(list(batch.uids), histories, [bool(r) for r in rows])
    proposals = [
        _propose(row, batch, i, inputs[i], drafted[i]) if row else [] for i, row in enumerate(rows)
    ]
    chosen = [(row.acceptance.p, len(p)) if row else (0.0, 0) for row, p in zip(rows, proposals)]
    explore = any(
        row is not None and p and not row.acceptance.known for row, p in zip(rows, proposals)
    )
    if explore:
        hoped = [(_hoped(row), len(p)) if row else (0.0, 0) for row, p in zip(rows, proposals)]
        explore = choose_width(hoped, spec.costs, spec.widest) > 1
    width = choose_width(chosen, spec.costs, spec.widest, 2 if explore else 1)
    if width == 1:
        for row, proposal in zip(rows, proposals):
            if row is not None and not proposal:
                row.record([], 0)  # asked and had nothing: counts against its acceptance
        _skipped([row if p else None for row, p in zip(rows, proposals)])
        spec.untimed()  # the sync cost this step its overlap with the last one
        return None
    proposals = [p[: width - 1] for p in proposals]
    outcomes = _verify(batch, inputs, proposals, rows)
    for row, proposal, outcome in zip(rows, proposals, outcomes):
        if row is not None:
            row.record(proposal, len(outcome.emitted) - 1)
    _roll_back(batch.prompt_cache, [len(p) for p in proposals], outcomes,
               getattr(batch, "cache_ops", None))  # fmt: skip
    responses = _respond(batch, outcomes)
    spec.verified(count, width, started)
    return responses


def _hoped(row: RowProposer) -> float:
    """The row's acceptance, or every token accepted while it is unknown (for deciding
    whether its first check could pay at all)."""
    return row.acceptance.p if row.acceptance.known else 1.0


def _skipped(rows: list[RowProposer | None]) -> None:
    for row in rows:
        if row is not None:
            row.skipped()


def _propose(row: RowProposer, batch: Any, i: int, token: int, drafted: list[int]) -> list[int]:
    room = batch.max_tokens[i] - batch._num_tokens[i] - 1
    return row.propose(batch.tokens[i] + [token], room, drafted)


def _verify(
    batch: Any, inputs: list[int], proposals: list[list[int]], rows: list[RowProposer | None]
) -> list[RowOutcome]:
    width = max(len(p) for p in proposals) + 1
    feed = [[t, *p] + [t] * (width - 1 - len(p)) for t, p in zip(inputs, proposals)]
    logits = batch.model(mx.array(feed, dtype=mx.uint32), cache=batch.prompt_cache)
    greedy = [_plain_greedy(batch, i) for i in range(len(inputs))]
    argmax = mx.argmax(logits, axis=-1).tolist() if any(greedy) else None
    wanted = batch.logprobs_wanted
    outcomes = []
    for i, (token, proposal) in enumerate(zip(inputs, proposals)):
        if argmax is not None and greedy[i]:
            outcome = _match_greedy(token, proposal, argmax[i], logits[i] if wanted else None)
        else:
            outcome = _match_sampled(batch, i, token, proposal, logits[i])
        outcome.logprobs[0] = batch._next_logprobs[i] if wanted else None
        row = rows[i]
        if row is not None and row.stop_cut is not None and not _constrained(batch, i):
            outcome = _cut_at_stop(outcome, row.stop_cut(batch.tokens[i], outcome.emitted))
        if batch.logits_processors[i]:
            context = batch._token_context[i]
            context.update_and_fetch(mx.array(outcome.emitted, dtype=context.tokens.dtype))
        outcomes.append(outcome)
    if wanted:
        mx.eval([o.logprobs for o in outcomes], [o.next_logprobs for o in outcomes])
    return outcomes


def _plain_greedy(batch: Any, i: int) -> bool:
    sampler = batch.samplers[i] if batch.samplers else None
    sampler = batch.fallback_sampler if sampler is None else sampler
    return sampler is greedy_sampler and not batch.logits_processors[i]


def _match_greedy(token: int, proposal: list[int], best: list[int], logits: Any) -> RowOutcome:
    accepted = 0
    while accepted < len(proposal) and best[accepted] == proposal[accepted]:
        accepted += 1
    logprobs: list[Any] = [None] * (accepted + 2)
    if logits is not None:
        normalized = logits[: accepted + 1] - mx.logsumexp(
            logits[: accepted + 1], axis=-1, keepdims=True
        )
        logprobs[1:] = list(normalized)
    return RowOutcome(
        [token, *proposal[:accepted]], logprobs[: accepted + 1], best[accepted], logprobs[-1]
    )


def _match_sampled(batch: Any, i: int, token: int, proposal: list[int], logits: Any) -> RowOutcome:
    """Sample position after position with the row's own sampler and processors, until
    a sampled token differs from the proposal's."""
    sampler = batch.samplers[i] if batch.samplers else None
    sampler = batch.fallback_sampler if sampler is None else sampler
    processors = batch.logits_processors[i] or ()
    context: Any = batch._token_context[i].tokens if processors else None
    emitted, logprobs = [token], [None]
    for j in range(len(proposal) + 1):
        row = logits[j : j + 1]
        if processors:
            seen = mx.concatenate([context, mx.array(emitted, dtype=context.dtype)])
            for processor in processors:
                row = processor(seen, row)
        row = row - mx.logsumexp(row, axis=-1, keepdims=True)
        if j and isinstance(sampler, RowConstraint):
            sampler.advance_alone()
        sampled = int(sampler(row).item())
        if j == len(proposal) or sampled != proposal[j]:
            return RowOutcome(emitted, logprobs, sampled, row[0])
        emitted.append(sampled)
        logprobs.append(row[0])
    raise AssertionError("unreachable")


def _constrained(batch: Any, i: int) -> bool:
    """A constrained row's matcher has consumed its accepted tokens already: it keeps
    them (the stop_sequences stage still ends the answer at a stop string)."""
    return bool(batch.samplers) and isinstance(batch.samplers[i], RowConstraint)


def _cut_at_stop(outcome: RowOutcome, end: int | None) -> RowOutcome:
    """Nothing after a token that completes a request stop string is emitted: the row
    goes on from there as it would without speculation (and the stop ends it)."""
    if end is None or end >= len(outcome.emitted):
        return outcome
    return RowOutcome(
        outcome.emitted[:end],
        outcome.logprobs[:end],
        outcome.emitted[end],
        outcome.logprobs[end],
    )


def _roll_back(cache: list[Any], proposed: list[int], outcomes: list[RowOutcome],
               ext: Any | None) -> None:  # fmt: skip
    width = max(proposed)
    trim_rows(cache, [width + 1 - len(o.emitted) for o in outcomes], ext)


def _respond(batch: Any, outcomes: list[RowOutcome]) -> list[Any]:
    """GenerationBatch.next()'s responses, several per row; a row ends at its first
    stop or length token and nothing after it is emitted or counted."""
    responses, keep = [], []
    for i, outcome in enumerate(outcomes):
        batch.tokens[i].extend(outcome.emitted)
        finished = False
        for position, token in enumerate(outcome.emitted):
            batch._num_tokens[i] += 1
            reason = "length" if batch._num_tokens[i] >= batch.max_tokens[i] else None
            if batch._matchers[i].advance(token):
                reason = "stop"
            if reason is not None:
                responses.append(_final(batch, i, outcome, position, reason))
                finished = True
                break
            responses.append(batch.Response(batch.uids[i], token, outcome.logprobs[position],
                                            None, None, None))  # fmt: skip
        if not finished:
            keep.append(i)
    batch._next_tokens = mx.array([o.next_token for o in outcomes], dtype=mx.uint32)
    batch._next_logprobs = [o.next_logprobs for o in outcomes]
    if len(keep) < len(batch.uids):
        batch.filter(keep)
    return responses


def _final(batch: Any, i: int, outcome: RowOutcome, position: int, reason: str) -> Any:
    """The finishing response, with the row's cache and tokens up to its last token."""
    unused = len(outcome.emitted) - 1 - position
    cache = batch.extract_cache(i)
    tokens = batch.tokens[i]
    if unused:
        for layer in cache:
            layer.trim(unused)
        tokens = tokens[:-unused]
    token = outcome.emitted[position]
    return batch.Response(batch.uids[i], token, outcome.logprobs[position], reason, cache, tokens)
