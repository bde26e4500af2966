"""How much to speculate: a cost model of the decode step and each row's acceptance.

A verification step feeds every row of the batch W tokens (its next token and a proposal
padded to the longest one), so its cost is that of a B x W forward pass, whatever each
row proposes. `StepCosts` learns that cost per batch size and width from the engine's
own steps (a moving average per (B, W), measured from the step's start to the next
one's); widths not measured yet are interpolated, or extrapolated from the widths that
were, or from PRIOR_SLOPE before any was. `Acceptance` estimates the share of a row's
proposed tokens the model accepts. With per-token acceptance p, a proposal of k tokens
yields (1 - p^(k+1)) / (1 - p) tokens (the row's next token and the accepted run), so
`choose_width` takes the W that maximises the batch's expected tokens per second of
step; W = 1 is the ordinary step. Faster multi-row kernels lower the measured costs
and the same rows then propose more; a batch where verification does not pay, or rows
whose proposals keep failing, do not speculate at all.
"""

from __future__ import annotations

from dataclasses import dataclass

# A W-token step's cost relative to a 1-token one before any W > 1 was measured at a
# batch size: 1 + PRIOR_SLOPE * (W - 1). Slightly below SmolLM2's on a 2-core Zen 4
# (W2 1.31x, W8 3.45x), so that a width is tried once and then known.
PRIOR_SLOPE = 0.25
COST_WEIGHT = 0.1  # weight of the newest step in a (B, W) cost's moving average
SPEED_WEIGHT = 0.3  # ... in the machine's speed (every step, whatever its (B, W))
OUTLIER = 4.0  # a step slower than this many times its estimate counts as this many
# Per-token acceptance before a row has proposed anything: prompt lookup, prediction.
PRIOR_ACCEPTANCE = 0.5
PRIOR_PREDICTION_ACCEPTANCE = 0.8
PRIOR_WEIGHT = 1.0  # the prior counts as this many tried tokens
MEMORY = 0.75  # weight of the past at each verification of the row (recent runs count)
# ... at each step it did not verify: the prior comes back (the row tries again) after
# a few steps; each proposal in a row of which nothing was accepted halves the fading
# (after the first), up to LONGEST_BACK_OFF of them.
IDLE_MEMORY = 0.9
LONGEST_BACK_OFF = 5


def expected_tokens(p: float, proposed: int) -> float:
    """Tokens a row emits in a step where it proposes `proposed` tokens, each accepted
    with probability `p` while all before it were: 1 + p + p^2 + ... + p^proposed."""
    if p >= 1.0:
        return float(proposed + 1)
    return (1.0 - p ** (proposed + 1)) / (1.0 - p)


@dataclass
class Acceptance:
    """A row's per-token acceptance: accepted over tried proposed tokens (a proposal of
    k with a accepted tried a + 1 tokens, or k when all were accepted), recent
    verifications weighted more, the prior filling in what is not known."""

    prior: float = PRIOR_ACCEPTANCE
    accepted: float = 0.0
    tried: float = 0.0
    failures: int = 0  # proposals in a row of which nothing was accepted

    @property
    def p(self) -> float:
        return (self.accepted + self.prior * PRIOR_WEIGHT) / (self.tried + PRIOR_WEIGHT)

    @property
    def known(self) -> bool:
        return self.tried > 0

    def observe(self, proposed: int, accepted: int) -> None:
        """A verification: `accepted` of `proposed` tokens (0 proposed: the row had
        nothing to propose, which counts as one refused token)."""
        tried = accepted + (1 if accepted < proposed or not proposed else 0)
        self.accepted = MEMORY * self.accepted + accepted
        self.tried = MEMORY * self.tried + tried
        if accepted or not proposed:
            self.failures = 0  # (nothing to propose costs a wait for the tokens only)
        else:
            self.failures = min(self.failures + 1, LONGEST_BACK_OFF)

    def idle(self) -> None:
        """A step without verifying: the evidence fades, the prior comes back (the more
        slowly, the more verifications in a row failed)."""
        fading = 1.0 - (1.0 - IDLE_MEMORY) / 2 ** max(0, self.failures - 1)
        self.accepted *= fading
        self.tried *= fading


class StepCosts:
    """Seconds per decode step by (batch size, tokens per row), learnt as the engine
    runs (engine thread only). Kept as a shape times a speed: each step's seconds move
    the speed (the machine's load, its clocks) and, divided by it, its own (B, W) cell;
    so cells timed at different moments stay comparable, and the choice between widths,
    which only compares cells of one batch size, does not drift with the load."""

    def __init__(self) -> None:
        self._shape: dict[int, dict[int, float]] = {}  # batch -> width -> seconds / speed
        self._warm: set[tuple[int, int]] = set()  # (batch, width > 1) that ran once
        self._speed = 1.0

    def record(self, batch: int, width: int, seconds: float) -> None:
        if width > 1 and (batch, width) not in self._warm:
            # The first verification at each (B, W > 1) is a warm-up, not a sample: it
            # runs cold (SmolLM2 here: ~1.6x the steady cost), and a width priced that
            # high is not chosen again, so its price would never be corrected.
            self._warm.add((batch, width))
            return
        row = self._shape.setdefault(batch, {})
        old = row.get(width)
        if old is None:
            row[width] = seconds / self._speed
            return
        seconds = min(seconds, OUTLIER * old * self._speed)  # at most OUTLIER x its estimate
        self._speed += SPEED_WEIGHT * (seconds / old - self._speed)
        if width == 1:
            # A batch size's ordinary step is the unit its widths are priced in: it moves
            # the speed only. (Moving both from one cell's samples let their split drift
            # with the noise, without bound: after ~2000 noisy ordinary steps the wider
            # steps were priced 1e80 times an ordinary one and speculation stopped.)
            return
        row[width] = old + COST_WEIGHT * (seconds / self._speed - old)

    def measured(self, batch: int, width: int) -> bool:
        return width in self._shape.get(batch, {})

    def estimate(self, batch: int, width: int) -> float:
        """A (B, W) step's seconds; in units of a 1-token step where none was measured."""
        return self._speed * self._relative(self._shape.get(batch, {}), width)

    @staticmethod
    def _relative(row: dict[int, float], width: int) -> float:
        base = row.get(1, 1.0)
        if width in row:
            return row[width]
        below = max((w for w in row if w < width), default=1)
        above = min((w for w in row if w > width), default=None)
        low = row.get(below, base)
        if above is not None:
            return low + (row[above] - low) * (width - below) / (above - below)
        slope = (low - base) / (below - 1) if below > 1 else PRIOR_SLOPE * base
        return low + max(slope, 0.0) * (width - below)


def choose_width(
    rows: list[tuple[float, int]], costs: StepCosts, widest: int, narrowest: int = 1
) -> int:
    """The tokens per row (1 = the ordinary step, up to `widest`, at least `narrowest`
    where any row can propose) that maximise the expected tokens per second of step;
    rows: (acceptance, tokens it can propose)."""
    batch = len(rows)
    longest = max((available for _, available in rows), default=0)
    best, best_rate = 1, -1.0
    for width in range(1, min(widest, longest + 1) + 1):
        if width < narrowest:
            continue
        tokens = sum(expected_tokens(p, min(width - 1, available)) for p, available in rows)
        rate = tokens / costs.estimate(batch, width)
        if rate > best_rate:
            best, best_rate = width, rate
    return best
