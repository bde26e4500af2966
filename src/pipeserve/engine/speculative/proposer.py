"""Where proposed tokens come from: prompt lookup and a request's predicted output.

Prompt lookup: the longest n-gram (ngram_max down to ngram_min tokens) that ends the
sequence and also occurs earlier in it (prompt or output) proposes the tokens that
followed its latest such occurrence (or, where the last proposal was accepted whole, the
occurrence it came from: an edited file is copied from one place). A prediction (Chat's
`prediction`) is tried first: it continues where the last accepted proposal left off,
else it is searched for an n-gram of at least two tokens (one token is too often the
wrong place); with nothing there, prompt lookup proposes.

How much a row proposes is not decided here: each row offers what it has (up to
`tokens_max`; up to `tokens` / `prediction_tokens` before its acceptance is known) and
keeps an estimate of its per-token acceptance; engine/speculative/policy.py weighs those
against the measured cost of wider steps and chooses how many tokens the step verifies,
none where it does not pay.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeserve.config.models import SpeculativeOptions
from pipeserve.engine.speculative.policy import (
    PRIOR_ACCEPTANCE,
    PRIOR_PREDICTION_ACCEPTANCE,
    Acceptance,
)

CANDIDATES = 32  # latest occurrences of an n-gram compared per lookup
PREDICTION_ANCHOR = 2  # tokens a prediction must match to be proposed from (elsewhere)


class NgramIndex:
    """Positions that follow each n-gram of a token list, appended to as it grows."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tokens: list[int] = []
        self.after: dict[tuple[int, ...], list[int]] = {}
        self.heads: set[tuple[int, ...]] = set()  # the first n - 1 tokens of each n-gram

    def extend(self, tokens: list[int]) -> None:
        n, own = self.n, self.tokens
        for token in tokens:
            own.append(token)
            if len(own) >= n:
                self.after.setdefault(tuple(own[-n:]), []).append(len(own))
                self.heads.add(tuple(own[len(own) - n : -1]))

    def may_follow(self, known: list[int]) -> bool:
        """Whether `known` plus one more token can end with an n-gram seen before (its
        last n - 1 tokens begin one): else a lookup after the next token finds nothing."""
        return len(known) >= self.n - 1 and tuple(known[len(known) - self.n + 1 :]) in self.heads

    def lookup(self, history: list[int], longest: int, expected: int = -1) -> int:
        """Where the continuation of `history`'s longest suffix n-gram (at most `longest`
        tokens) starts in this index's tokens; -1 when its last `n` tokens occur nowhere
        else. Among equally long matches the first at or after `expected` wins (a text
        being copied is copied in order: after a change it goes on further down), else
        the latest."""
        n, own = self.n, self.tokens
        if len(history) < n:
            return -1
        positions = self.after.get(tuple(history[-n:]))
        if not positions:
            return -1
        best, best_len = -1, 0
        for position in _in_order_of_preference(positions, expected):
            if position >= len(own):
                continue  # nothing follows it (or it is the suffix itself)
            length = n
            while (
                length < longest
                and length < position
                and length < len(history)
                and own[position - length - 1] == history[-length - 1]
            ):
                length += 1
            if length > best_len:
                best, best_len = position, length
        return best


def _in_order_of_preference(positions: list[int], expected: int) -> list[int]:
    """The nearest CANDIDATES / 2 positions at or after `expected` (ascending), then the
    latest of the others (descending); `positions` is ascending."""
    if expected < 0:
        return positions[: -CANDIDATES - 1 : -1]
    split = bisect.bisect_left(positions, expected)
    ahead = positions[split : split + CANDIDATES // 2]
    return ahead + positions[max(0, split - CANDIDATES // 2) : split][::-1]


@dataclass
class RowProposer:
    """One sequence's proposals, acceptance estimate and counters (engine thread only)."""

    options: SpeculativeOptions
    lookup: bool  # prompt lookup is configured for the model
    drafted: bool = False  # a draft model proposes for it (engine/speculative/draft.py)
    prediction: list[int] | None = None
    # (tokens before, new tokens) -> how many new tokens to emit, so that none follows
    # one that completes a stop string (None: all of them).
    stop_cut: Callable[[list[int], list[int]], int | None] | None = None
    proposed: int = 0
    accepted: int = 0
    prediction_accepted: int = 0
    acceptance: Acceptance = field(default_factory=Acceptance)
    from_prediction: bool = False  # the pending proposal came from the prediction
    looked_up: bool = False  # ... from prompt lookup (else from a draft model)
    _history: NgramIndex | None = None
    _predicted: NgramIndex | None = None
    _predicted_at: int = 1  # where the prediction is expected to continue
    _looked_up_at: int = -1  # where the history is expected to continue (prompt lookup)
    _proposal_at: int = 0  # where the pending proposal starts (prediction or history)
    _unmatched: Counter[int] = field(default_factory=Counter)  # prediction less output

    def __post_init__(self) -> None:
        if self.lookup:
            self._history = NgramIndex(self.options.ngram_min)
        prior = PRIOR_ACCEPTANCE
        if self.prediction:
            self._predicted = NgramIndex(min(PREDICTION_ANCHOR, self.options.ngram_max))
            self._predicted.extend(self.prediction)
            self._unmatched = Counter(self.prediction)
            prior = PRIOR_PREDICTION_ACCEPTANCE
        self.acceptance = Acceptance(prior)

    @property
    def reach(self) -> int:
        """The most tokens it may propose now: `tokens` (`prediction_tokens` with a
        prediction) until its acceptance is known, then `tokens_max`; a draft model's
        rows always its `tokens`."""
        options = self.options
        if self.drafted and not self.prediction:
            return options.tokens
        if self.acceptance.known:
            return options.tokens_max
        return options.prediction_tokens if self.prediction else options.tokens

    def emitted(self, token_id: int) -> None:
        """A token of the completion: it matches one occurrence in the prediction."""
        if self.prediction and self._unmatched[token_id] > 0:  # per token: cheap without one
            self._unmatched[token_id] -= 1

    @property
    def prediction_rejected(self) -> int:
        """OpenAI's definition: the prediction's tokens that did not appear in the
        completion (not merely those proposed and refused)."""
        return sum(self._unmatched.values())

    def ready(self) -> bool:
        """Whether it has a source of proposals (configured, or a prediction)."""
        return self.lookup or self.drafted or bool(self.prediction)

    def may_propose(self, known: list[int]) -> bool:
        """Whether it may have a proposal once the token after `known` (the sequence
        without the token being decoded) is known. Only prompt lookup can tell before:
        where the last ngram_min - 1 tokens begin no n-gram seen earlier, it has none,
        and waiting for the next token to find that out would cost the step its overlap
        with the one before (a random-weight model's rows: every few steps)."""
        index = self._history
        if self.drafted or self.prediction or index is None:
            return True
        index.extend(known[len(index.tokens) :])
        return index.may_follow(known)

    def propose(self, history: list[int], room: int, drafted: list[int] | None = None) -> list[int]:
        """Up to `room` (and `reach`) tokens that may follow `history` (the sequence so
        far: prompt, output and the token about to be decoded); `drafted`: a draft
        model's tokens, proposed where the prediction has none."""
        if room <= 0:
            return []
        index = self._history
        if index is not None:
            index.extend(history[len(index.tokens) :])
        limit = min(room, self.reach)
        proposal = self._from_prediction(history, limit)
        self.from_prediction = bool(proposal)
        if not proposal and index is not None:
            start = index.lookup(index.tokens, self.options.ngram_max, self._looked_up_at)
            if start >= 0:
                self._proposal_at = start
                proposal = index.tokens[start : start + limit]
        self.looked_up = bool(proposal) and not self.from_prediction
        if not proposal and drafted:
            proposal = drafted[:room]
        return proposal

    def _from_prediction(self, history: list[int], limit: int) -> list[int]:
        predicted, prediction = self._predicted, self.prediction
        if predicted is None or prediction is None:
            return []
        start = self._predicted_at
        if not (0 < start < len(prediction) and prediction[start - 1] == history[-1]):
            start = predicted.lookup(history, self.options.ngram_max, start)
        if start < 0:
            return []
        self._proposal_at = start
        return prediction[start : start + limit]

    def record(self, proposal: list[int], accepted: int) -> None:
        """`accepted` of `proposal`'s tokens were emitted (an empty proposal: the row had
        nothing to propose in a step that verified)."""
        self.acceptance.observe(len(proposal), accepted)
        if not proposal:
            return
        self.proposed += len(proposal)
        self.accepted += accepted
        # Where the sequence goes on if the token after the accepted ones follows suit.
        follows = self._proposal_at + accepted + 1
        if self.from_prediction:
            self.prediction_accepted += accepted
            self._predicted_at = follows
        if self.looked_up:
            self._looked_up_at = follows if accepted == len(proposal) else -1

    def skipped(self) -> None:
        """A step that did not verify anything for it."""
        self.acceptance.idle()


STOP_CONTEXT = 32  # tokens of the text before that a stop string may start in


def stop_cutter(
    tokenizer: Any, stops: tuple[str, ...]
) -> Callable[[list[int], list[int]], int | None]:
    """The `stop_cut` of a request with stop strings: decodes the new tokens one by one
    after the last STOP_CONTEXT tokens before them."""
    longest = max(len(stop) for stop in stops)

    def cut(before: list[int], new: list[int]) -> int | None:
        context = before[-STOP_CONTEXT:]
        start = max(0, len(tokenizer.decode(context)) - longest + 1)
        for end in range(1, len(new)):
            text = tokenizer.decode(context + new[:end])
            if any(text.find(stop, start) >= 0 for stop in stops):
                return end
        return None

    return cut
