"""What the decode step needs to speculate, kept across steps: each row's proposer, the
draft model (method draft), the measured step costs and the clock that times each step.

The scheduler (mlx/scheduler.py) gives a row its proposer when it joins; the generator's
decode step (mlx/generator.py) times every step here and hands the state to verify.py.
"""

from __future__ import annotations

import time

from pipeserve.engine.speculative.draft import DraftProposer
from pipeserve.engine.speculative.policy import StepCosts
from pipeserve.engine.speculative.proposer import RowProposer


class Speculation:
    """What a decode step needs to speculate: each row's proposer (by uid), the step
    costs learnt so far, the bounds (`max_rows` decoding rows, `widest` tokens per row)
    and the clock that times each step for the costs."""

    def __init__(self, max_rows: int | None, widest: int) -> None:
        self.proposers: dict[int, RowProposer] = {}
        self.max_rows = max_rows
        self.widest = widest
        self.costs = StepCosts()
        self.draft: DraftProposer | None = None  # method draft: the draft model's proposals
        # The step in flight: (batch, width, when its cost started counting); None when
        # it cannot be timed (a prompt was prefilled in its call, the step followed one
        # whose work it waits for, ...).
        self.timing: tuple[int, int, float] | None = None
        self._steady = 0  # the batch size of the last untouched ordinary step (0: none)

    def clear(self) -> None:
        """The batch is idle: nothing to propose for, and the time until the next step
        (the next request's) is no step's cost."""
        self.proposers.clear()
        self.untimed()
        if self.draft is not None:
            self.draft.clear()

    def step_begins(self) -> float:
        """A decode step starts now: the previous one's seconds go to the costs."""
        now = time.perf_counter()
        if self.timing is not None:
            batch, width, started = self.timing
            self.costs.record(batch, width, now - started)
        self.timing = None
        return now

    def ordinary(self, batch: int, started: float) -> None:
        """An ordinary step was launched. Its seconds are those until the next step
        begins only after another ordinary step of the same batch: before, the next
        step's wait holds some of the last one's work (pipelined steps)."""
        if self._steady == batch:
            self.timing = (batch, 1, started)
        self._steady = batch

    def verified(self, batch: int, width: int, started: float) -> None:
        """A verification step ran (synchronously) from `started`."""
        self.timing = (batch, width, started)
        self._steady = 0

    def untimed(self) -> None:
        """The step cannot be timed (prefill work in its call, a sync for nothing)."""
        self.timing = None
        self._steady = 0
