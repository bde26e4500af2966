"""Where proposed tokens come from: prompt lookup and a request's predicted output.

Prompt lookup: the longest n-gram (ngram_max down to ngram_min tokens) that ends the
sequence and also occurs earlier in it (prompt or output) proposes the tokens that
followed its latest such occurrence (or, where the last proposal was accepted whole, the
occurrence it came from: an edited file is copied from one place). A prediction (Chat's
`prediction`) is tried first: it continues where the last accepted proposal left off,
else it is searched for an n-gram of at least two tokens (one token is too often the
wrong place); with nothing there, prompt lookup proposes.

Proposal length adapts per row: it starts at `tokens` (`prediction_tokens` for a row
with a prediction), grows to 2n + 1 (1, 3, 7, 15: with the next token, a multiple of
the CPU kernels' 4-row passes) while proposals are accepted whole, up to `tokens_max`,
and shrinks to (n - 1) / 2 at a rejection, down to one token. So copying a file
proposes long runs while chat proposes little. Each row also backs off on its own:
after MISSES_BEFORE_PAUSE steps in a row where it had nothing to propose or nothing of
its proposal was accepted, it stops proposing for a while, twice as long each time it
fails again, so open-ended text costs (almost) nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeserve.config.models import SpeculativeOptions

MISSES_BEFORE_PAUSE = 2
FIRST_PAUSE = 4  # decode steps without proposals after the first run of misses
LONGEST_PAUSE = 64
CANDIDATES = 32  # latest occurrences of an n-gram compared per lookup
PREDICTION_ANCHOR = 2  # tokens a prediction must match to be proposed from (elsewhere)


def longer(length: int, ceiling: int) -> int:
    return min(ceiling, 2 * length + 1)


def shorter(length: int) -> int:
    return max(1, (length - 1) // 2)


class NgramIndex:
    """Positions that follow each n-gram of a token list, appended to as it grows."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tokens: list[int] = []
        self.after: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens: list[int]) -> None:
        n, own = self.n, self.tokens
        for token in tokens:
            own.append(token)
            if len(own) >= n:
                self.after.setdefault(tuple(own[-n:]), []).append(len(own))

    def lookup(self, history: list[int], longest: int, prefer: int = -1) -> int:
        """Where the continuation of `history`'s longest suffix n-gram (at most `longest`
        tokens) starts in this index's tokens; -1 when its last `n` tokens occur nowhere
        else. Among equally long matches the one at `prefer` wins, else the latest."""
        n, own = self.n, self.tokens
        if len(history) < n:
            return -1
        positions = self.after.get(tuple(history[-n:]))
        if not positions:
            return -1
        candidates = list(reversed(positions[-CANDIDATES:]))
        if n <= prefer < len(own) and own[prefer - n : prefer] == history[-n:]:
            candidates.insert(0, prefer)
        best, best_len = -1, 0
        for position in candidates:
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


@dataclass
class RowProposer:
    """One sequence's proposals, back-off and counters (engine thread only)."""

    options: SpeculativeOptions
    lookup: bool  # prompt lookup is configured for the model
    drafted: bool = False  # a draft model proposes for it (engine/draft.py)
    prediction: list[int] | None = None
    # (tokens before, new tokens) -> how many new tokens to emit, so that none follows
    # one that completes a stop string (None: all of them).
    stop_cut: Callable[[list[int], list[int]], int | None] | None = None
    proposed: int = 0
    accepted: int = 0
    prediction_accepted: int = 0
    misses: int = 0
    paused_until: int = 0
    pause: int = FIRST_PAUSE
    length: int = 0  # tokens the next proposal may have (adapts; set from options)
    from_prediction: bool = False  # the pending proposal came from the prediction
    looked_up: bool = False  # ... from prompt lookup (else from a draft model)
    _history: NgramIndex | None = None
    _predicted: NgramIndex | None = None
    _predicted_at: int = 1  # where the prediction is expected to continue
    _looked_up_at: int = -1  # where the history is expected to continue (prompt lookup)
    _proposal_at: int = 0  # where the pending proposal starts (prediction or history)
    _unmatched: Counter[int] = field(default_factory=Counter)  # prediction less output

    def __post_init__(self) -> None:
        options = self.options
        self.length = options.prediction_tokens if self.prediction else options.tokens
        self.length = min(self.length, options.tokens_max)
        if self.lookup:
            self._history = NgramIndex(options.ngram_min)
        if self.prediction:
            self._predicted = NgramIndex(min(PREDICTION_ANCHOR, options.ngram_max))
            self._predicted.extend(self.prediction)
            self._unmatched = Counter(self.prediction)

    def emitted(self, token_id: int) -> None:
        """A token of the completion: it matches one occurrence in the prediction."""
        if self.prediction and self._unmatched[token_id] > 0:  # per token: cheap without one
            self._unmatched[token_id] -= 1

    @property
    def prediction_rejected(self) -> int:
        """OpenAI's definition: the prediction's tokens that did not appear in the
        completion (not merely those proposed and refused)."""
        return sum(self._unmatched.values())

    def ready(self, step: int) -> bool:
        """Whether it may propose at this step (configured, and not backing off)."""
        return (self.lookup or self.drafted or bool(self.prediction)) and step >= self.paused_until

    def propose(
        self, history: list[int], room: int, step: int, drafted: list[int] | None = None
    ) -> list[int]:
        """Up to `room` tokens that may follow `history` (the sequence so far: prompt,
        output and the token about to be decoded); `drafted`: a draft model's tokens,
        proposed where the prediction has none."""
        if room <= 0 or step < self.paused_until:
            return []
        index = self._history
        if index is not None:
            index.extend(history[len(index.tokens) :])
        limit = min(room, self.length)
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
        if not proposal:
            # Nothing to propose counts as a miss too: a row that has nothing lets the
            # batch take the ordinary step, which overlaps the next pass with this one.
            self._miss(step)
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

    def record(self, proposal: list[int], accepted: int, step: int) -> None:
        """`accepted` of `proposal`'s tokens were emitted."""
        self.proposed += len(proposal)
        self.accepted += accepted
        # Where the sequence goes on if the token after the accepted ones follows suit.
        follows = self._proposal_at + accepted + 1
        if self.from_prediction:
            self.prediction_accepted += accepted
            self._predicted_at = follows
        if self.looked_up:
            self._looked_up_at = follows if accepted == len(proposal) else -1
        if self.from_prediction or self.looked_up:  # a draft's length is the draft's own
            self._adapt(len(proposal), accepted)
        if accepted:
            self.misses, self.pause = 0, FIRST_PAUSE
            return
        self._miss(step)

    def _adapt(self, proposed: int, accepted: int) -> None:
        if accepted < proposed:
            self.length = shorter(self.length)
        elif accepted >= self.length:
            self.length = longer(self.length, self.options.tokens_max)

    def _miss(self, step: int) -> None:
        self.misses += 1
        if self.misses >= MISSES_BEFORE_PAUSE:
            self.paused_until = step + self.pause
            self.pause = min(LONGEST_PAUSE, self.pause * 2)
            self.misses = 0


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
