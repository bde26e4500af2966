"""Constrained decoding inside mlx-lm's continuous batching (engine thread only).

A constrained request's sampler is wrapped: before the real sampler (greedy,
temperature, top-p, seeded ...) draws from its row, the row's log-probabilities
outside the grammar's allowed-token mask become -inf (and are renormalised, so top-p
and min-p see the constrained distribution); the token it returns is remembered and
fed to the grammar matcher at the next step. Bias and penalty processors run before,
on the logits, as usual. When the grammar is complete only EOS is allowed, so the
request ends with a normal stop.

Masks for all constrained rows of a step are computed together, on llguidance's
threads, at the first constrained row's sampling call, after that step's forward pass
has been started (`mx.async_eval`): the pass runs while the CPU consumes the previous
tokens and computes the masks, instead of one after the other.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from pipeserve.engine.sampling.grammar import Constraint

log = logging.getLogger("pipeserve.engine")

Sampler = Callable[[mx.array], mx.array]
SUBSET_LIMIT = 16384  # draw among the allowed tokens when there are at most this many
SUBSET_MIN = 16
BIAS_ROWS = 16  # full-vocabulary bias rows kept per batch (about 0.6 MB each at 150k)
_BIAS = np.array([-np.inf, 0.0], dtype=np.float32)  # banned, allowed


@dataclass(frozen=True, slots=True)
class SamplerFilters:
    """What the request's sampler does besides drawing: whether it needs normalised
    log-probabilities (top-p, min-p) and whether it may draw from a shortened row (not
    with top-k, which expects the whole vocabulary)."""

    normalize: bool
    subsets: bool


class RowConstraint:
    """One request's matcher and its sampler wrapper.

    Where the grammar allows few tokens (JSON structure, enums, keys) the inner sampler
    draws from just those: their log-probabilities are gathered into a short row
    (padded with -inf to a power of two, so compiled samplers see few shapes) and the
    draw is mapped back to token ids. Where it allows many (free string text) the whole
    row gets a 0 / -inf bias. Either way the draw sees only allowed tokens.
    """

    __slots__ = (
        "inner", "mask", "matcher", "normalize", "owner", "previous", "sampled_at", "spec",
        "subsets",
    )  # fmt: skip

    def __init__(
        self, owner: ConstraintSet, spec: Constraint, inner: Sampler, filters: SamplerFilters
    ) -> None:
        self.owner = owner
        self.spec = spec
        self.matcher = spec.matcher
        self.inner = inner
        self.normalize = filters.normalize
        self.subsets = filters.subsets
        self.previous: mx.array | None = None  # token sampled last step, not yet consumed
        self.mask: np.ndarray | None = None  # allowed tokens in the matcher's current state
        self.sampled_at = -1  # the owner's step number of the last sampling call

    def __call__(self, logprobs: mx.array) -> mx.array:
        if self.mask is None:
            self.owner.refresh(logprobs)
        assert self.mask is not None
        allowed = allowed_bits(self.mask, logprobs.shape[-1])
        count = np.count_nonzero(allowed)  # ids are listed only where they are used
        if count == 1:
            token = mx.array(np.flatnonzero(allowed).astype(np.uint32))  # forced: no draw
        elif count <= SUBSET_LIMIT and self.subsets:
            token = self._draw_among(logprobs, np.flatnonzero(allowed))
        else:
            masked = logprobs + self.owner.bias_row(self.mask, allowed)[None]
            token = self.inner(_normalized(masked) if self.normalize else masked)
        self.previous, self.mask, self.sampled_at = token, None, self.owner.step
        return token

    def advance_alone(self) -> None:
        """Consume the token sampled last and compute this row's mask on its own: a
        speculative step samples a row again at its next position only when the token
        before was accepted, so the matcher never holds a rejected token."""
        from llguidance.numpy import fill_next_token_bitmask

        if self.previous is not None:
            token = int(self.previous.reshape(-1).item())
            self.previous = None
            if not self.matcher.is_stopped():
                self.matcher.consume_token(token)
        mask = np.zeros((1, (self.spec.vocab_size + 31) // 32), dtype=np.int32)
        fill_next_token_bitmask(self.matcher, mask, 0)
        self.mask = mask[0]
        if not self.mask.any():
            log.warning("grammar matcher failed: %s", self.matcher.get_error()[:200])
            ConstraintSet._allow_eos(self)

    def _draw_among(self, logprobs: mx.array, ids: np.ndarray) -> mx.array:
        width = max(SUBSET_MIN, 1 << (len(ids) - 1).bit_length())
        padded = np.full(width, ids[0], dtype=np.uint32)
        padded[: len(ids)] = ids
        index = mx.array(padded)
        row = mx.take(logprobs, index, axis=-1)
        if width > len(ids):
            row = mx.where(mx.arange(width) < len(ids), row, -mx.inf)
        if self.normalize:
            row = _normalized(row)
        return mx.take(index, self.inner(row))


class ConstraintSet:
    """All constrained rows of one Batch; `begin_step` before each BatchGenerator step."""

    def __init__(self, threads: int | None = None) -> None:
        import llguidance

        self.executor = llguidance.LLExecutor(threads)
        self.rows: dict[int, RowConstraint] = {}
        self.bias_rows: OrderedDict[bytes, mx.array] = OrderedDict()
        self.step = 0

    def wrap(
        self, key: int, spec: Constraint, sampler: Sampler, filters: SamplerFilters
    ) -> Sampler:
        row = RowConstraint(self, spec, sampler, filters)
        self.rows[key] = row
        return row

    def bias_row(self, mask: np.ndarray, allowed: np.ndarray) -> mx.array:
        """The 0 / -inf row of a mask, kept on the device for masks seen recently: free
        text repeats one mask step after step, so its row is built once, not per step."""
        key = mask.tobytes() + len(allowed).to_bytes(4, "little")
        row = self.bias_rows.get(key)
        if row is None:
            row = mx.array(_BIAS[allowed.view(np.uint8)])
            self.bias_rows[key] = row
            while len(self.bias_rows) > BIAS_ROWS:
                self.bias_rows.popitem(last=False)
        else:
            self.bias_rows.move_to_end(key)
        return row

    def release(self, key: int) -> None:
        self.rows.pop(key, None)

    def clear(self) -> None:
        self.rows.clear()

    def begin_step(self) -> None:
        self.step += 1

    def refresh(self, logprobs: mx.array) -> None:
        """Consume last step's tokens and compute the masks of every row that needs one.

        Rows sampled earlier in this step are skipped: their new token is still being
        computed and their next mask belongs to the next step.
        """
        from llguidance.numpy import fill_next_token_bitmask_par

        due = [r for r in self.rows.values() if r.mask is None and r.sampled_at != self.step]
        if not due:
            return
        mx.async_eval(logprobs)  # start this step's forward pass first
        fed = [r for r in due if r.previous is not None]
        if fed:
            tokens = mx.concatenate([r.previous.reshape(-1) for r in fed]).tolist()  # type: ignore[union-attr]
            for row, token in zip(fed, tokens):
                row.previous = None
                if not row.matcher.is_stopped():
                    row.matcher.consume_token(int(token))
        words = (max(r.spec.vocab_size for r in due) + 31) // 32
        masks = np.zeros((len(due), words), dtype=np.int32)
        fill_next_token_bitmask_par(
            self.executor, [(r.matcher, i) for i, r in enumerate(due)], masks
        )
        for i, row in enumerate(due):
            row.mask = masks[i]
            if not row.mask.any():  # a matcher in an error state: end the answer
                log.warning("grammar matcher failed: %s", row.matcher.get_error()[:200])
                self._allow_eos(row)

    @staticmethod
    def _allow_eos(row: RowConstraint) -> None:
        assert row.mask is not None
        bits = row.mask.view(np.uint32)
        for token in row.spec.eos_ids:
            bits[token // 32] |= np.uint32(1 << (token % 32))


def allowed_bits(mask: np.ndarray, width: int) -> np.ndarray:
    """The mask's bits as `width` booleans (tokens past the mask are banned)."""
    # `count` cuts the bits to `width`, or pads them with zeros past the mask's end.
    bits = np.unpackbits(mask.view(np.uint8), count=width, bitorder="little")
    return bits.view(np.bool_)


def _normalized(row: mx.array) -> mx.array:
    return row - mx.logsumexp(row, axis=-1, keepdims=True)
