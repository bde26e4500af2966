"""A think block's token budget, followed token by token (engine thread only).

`BudgetTracker` reads a row's generated tokens as they are delivered: it notices the
block's start marker (unless the prompt opened the block), counts the tokens inside, and
notices the model's own end marker (the budget is then done). When the count reaches the
budget inside the block it answers the tokens to force, one per delivered token: the
family's close text (`ThinkingLimit.close_ids`, e.g. `</think>` and the blank line). The
scheduler puts each in place of the row's next input (engine/mlx/generator.py
`force_next`), so the model reads the close as if it had written it and the answer
follows; the replay engine rewrites its script the same way (`budgeted_script`).

Only the first think block of an answer is budgeted (interleaved thinking after tool
results starts a new request, which has its own budget).
"""

from __future__ import annotations

from collections import deque

from pipeserve.engine.base import ThinkingLimit


class BudgetTracker:
    """One row's think block: outside, inside (counting), forcing the close, done."""

    __slots__ = ("forcing", "limit", "recent", "spent", "state")

    def __init__(self, limit: ThinkingLimit) -> None:
        self.limit = limit
        self.spent = 0  # tokens generated inside the block (markers excluded)
        self.state = "inside" if limit.opened else "outside"
        self.forcing: deque[int] = deque()  # close tokens still to force
        width = max(len(limit.start_ids), len(limit.end_ids), 1)
        self.recent: deque[int] = deque(maxlen=width)

    @property
    def done(self) -> bool:
        return self.state == "done"

    def start(self) -> int | None:
        """Before the first token: a block the prompt opened with a zero budget is closed
        at once."""
        if self.state == "inside" and self.limit.budget <= 0:
            return self._close()
        return None

    def after(self, token: int) -> int | None:
        """Read one delivered token; the token to force next, or None."""
        if self.state == "forcing":
            return self._next_forced()
        if self.state == "done":
            return None
        self.recent.append(token)
        if self.state == "outside":
            if ends_with(self.recent, self.limit.start_ids):
                self.state = "inside"
                self.recent.clear()
                return self._close() if self.limit.budget <= 0 else None
            return None
        if ends_with(self.recent, self.limit.end_ids):
            self.state = "done"  # the model closed the block itself
            return None
        self.spent += 1
        return self._close() if self.spent >= self.limit.budget else None

    def _close(self) -> int | None:
        self.state = "forcing"
        self.forcing = deque(self.limit.close_ids)
        return self._next_forced()

    def _next_forced(self) -> int | None:
        if not self.forcing:
            self.state = "done"
            return None
        return self.forcing.popleft()


def ends_with(recent: deque[int], marker: tuple[int, ...]) -> bool:
    n = len(marker)
    return 0 < n <= len(recent) and tuple(recent)[-n:] == marker


def budgeted_script(tokens: list[int], limit: ThinkingLimit) -> list[int]:
    """A scripted completion (the replay engine's) as a budgeted model would write it:
    past the budget, the close tokens, then the script from after its own end marker
    (and after the rest of the close text where the script has it there too)."""
    tracker = BudgetTracker(limit)
    out: list[int] = []
    forced = tracker.start()
    position = 0
    while position < len(tokens) or forced is not None:
        if forced is not None:
            out.append(forced)
            forced = tracker.after(forced)
            if forced is None:
                position = resume_after_close(tokens, position, limit)
            continue
        out.append(tokens[position])
        forced = tracker.after(tokens[position])
        position += 1
    return out


def resume_after_close(tokens: list[int], position: int, limit: ThinkingLimit) -> int:
    """Where the script goes on after a forced close: past its own end marker and the
    close text's tail that follows it; the end of the script when it never closes."""
    marker = limit.end_ids
    for i in range(position, len(tokens) - len(marker) + 1):
        if tuple(tokens[i : i + len(marker)]) == marker:
            after = i + len(marker)
            tail = (
                limit.close_ids[len(marker) :] if limit.close_ids[: len(marker)] == marker else ()
            )
            if tail and tuple(tokens[after : after + len(tail)]) == tail:
                after += len(tail)
            return after
    return len(tokens)


__all__ = ["BudgetTracker", "budgeted_script"]
