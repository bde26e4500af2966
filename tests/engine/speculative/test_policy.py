"""The speculation cost model (engine/speculative/policy.py): how wide a step verifies, from the
rows' acceptance and the step costs, and how those two are learnt."""

from __future__ import annotations

import random
import time

import pytest

from pipeserve.config.models import SpeculativeOptions
from pipeserve.engine.mlx.generator import Speculation
from pipeserve.engine.speculative.policy import (
    PRIOR_SLOPE,
    Acceptance,
    StepCosts,
    choose_width,
    expected_tokens,
)
from pipeserve.engine.speculative.proposer import RowProposer

# Seconds of a step by tokens per row: SmolLM2 on 2 CPU cores at batch 1 and 8
# (docs/speculative.md), and a device where a wider step costs next to nothing.
CPU = {1: {1: 13.8, 2: 18.1, 4: 29.3, 8: 47.6}, 8: {1: 39.0, 2: 62.0, 4: 106.0, 8: 215.0}}
FLAT = {1: {1: 10.0, 2: 10.2, 4: 10.4, 8: 10.8}}


def costs(table: dict[int, dict[int, float]]) -> StepCosts:
    learnt = StepCosts()
    for batch, widths in table.items():
        for width, seconds in widths.items():
            learnt.record(batch, width, seconds)
            if width > 1:
                learnt.record(batch, width, seconds)  # the first one was the warm-up
    return learnt


def test_expected_tokens_of_a_proposal() -> None:
    assert expected_tokens(0.0, 7) == 1.0
    assert expected_tokens(1.0, 7) == 8.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_width_follows_acceptance_and_cost() -> None:
    cpu, flat = costs(CPU), costs(FLAT)
    assert choose_width([(0.2, 7)], cpu, 8) == 1  # refused proposals do not pay
    assert choose_width([(0.6, 7)], cpu, 8) == 2
    assert choose_width([(0.97, 7)], cpu, 8) == 8
    assert choose_width([(0.6, 7)], flat, 8) == 8  # where width is cheap, propose more
    assert choose_width([(0.97, 2)], cpu, 8) == 3  # no wider than the longest proposal
    assert choose_width([(0.97, 7)], cpu, 4) == 4  # nor than the bound
    assert choose_width([(0.97, 0)], cpu, 8) == 1  # nothing to propose


def test_a_large_batch_verifies_only_where_most_rows_are_accepted() -> None:
    cpu = costs(CPU)
    assert choose_width([(0.5, 7)] * 8, cpu, 8) == 1
    assert choose_width([(0.97, 7)] * 8, cpu, 8) > 1
    assert choose_width([(0.97, 7)] + [(0.0, 0)] * 7, cpu, 8) == 1  # one row cannot carry it


def test_a_row_learning_its_acceptance_explores_at_least_two_tokens() -> None:
    assert choose_width([(0.1, 3)], costs(CPU), 8, narrowest=2) == 2


def test_step_costs_interpolate_and_extrapolate_from_what_was_measured() -> None:
    learnt = costs({1: {1: 10.0, 4: 25.0}})
    assert learnt.estimate(1, 2) == pytest.approx(15.0)
    assert learnt.estimate(1, 8) == pytest.approx(45.0)  # the measured slope goes on
    assert learnt.measured(1, 4) and not learnt.measured(1, 2)
    fresh = costs({2: {1: 20.0}})
    assert fresh.estimate(2, 3) == pytest.approx(20.0 * (1 + 2 * PRIOR_SLOPE))
    assert StepCosts().estimate(4, 1) == 1.0  # nothing known: in units of a step


def ratio(learnt: StepCosts) -> float:
    return learnt.estimate(1, 2) / learnt.estimate(1, 1)


def test_step_costs_follow_the_machine_and_resist_one_slow_step() -> None:
    learnt = costs({1: {1: 10.0, 2: 20.0}})
    for _ in range(60):  # faster kernels for two rows
        learnt.record(1, 2, 10.0)
        learnt.record(1, 1, 10.0)
    assert ratio(learnt) == pytest.approx(1.0, rel=0.1)
    before = ratio(learnt)
    learnt.record(1, 2, 1000.0)  # a pause of the process
    assert ratio(learnt) == pytest.approx(before, rel=0.25)


def test_a_first_cold_verification_does_not_price_its_width() -> None:
    """The first W-token step of a process runs cold: it is not a sample (priced that
    high the width would never be chosen again to correct it)."""
    learnt = costs({1: {1: 10.0}})
    learnt.record(1, 2, 25.0)  # cold
    assert not learnt.measured(1, 2)
    learnt.record(1, 2, 12.0)
    assert learnt.estimate(1, 2) == pytest.approx(12.0)


def test_a_loaded_machine_keeps_the_cost_ratios() -> None:
    """Ordinary steps timed while the machine was busy (3x slower), two-token steps
    later on a quiet one: the ratio of the two stays near the quiet one (1.3), where an
    average of each cell's own seconds would give 0.43 (two tokens cheaper than one)."""
    learnt = costs({1: {1: 10.0, 2: 13.0}})
    for _ in range(20):
        learnt.record(1, 1, 30.0)
    for _ in range(20):
        learnt.record(1, 2, 13.0)
    assert ratio(learnt) > 0.8


def test_acceptance_falls_with_refusals_and_the_prior_returns_while_idle() -> None:
    row = Acceptance(prior=0.5)
    assert not row.known and row.p == 0.5
    for _ in range(4):
        row.observe(3, 0)
    low = row.p
    assert row.known and low < 0.2
    for _ in range(20):
        row.idle()
    assert low < row.p < 0.5
    for _ in range(4):
        row.observe(7, 7)
    assert row.p > 0.9
    row.observe(0, 0)  # asked, had nothing to propose
    assert row.p < 0.9


def steps_until_tried_again(row: Acceptance, p: float = 0.35) -> int:
    steps = 0
    while row.p < p:
        row.idle()
        steps += 1
    return steps


def test_proposals_failing_in_a_row_back_off_longer_and_nothing_to_propose_does_not() -> None:
    def after(proposed: int, times: int) -> Acceptance:
        row = Acceptance(prior=0.5)
        for _ in range(times):
            row.observe(proposed, 0)
        return row

    twice = steps_until_tried_again(after(3, 2))
    assert steps_until_tried_again(after(3, 5)) > 4 * twice
    assert steps_until_tried_again(after(0, 5)) < twice


def test_prompt_lookup_tells_before_the_next_token_when_it_has_nothing() -> None:
    """A row whose last token begins no earlier 2-gram cannot propose whatever token
    comes next (so the step need not wait for that token to find out); where it may,
    some next token gives a proposal."""
    options = SpeculativeOptions(method="prompt_lookup", ngram_min=2, ngram_max=4)
    rng = random.Random(7)
    history = [rng.randrange(12) for _ in range(40)]
    for end in range(2, len(history)):
        known = history[:end]
        row = RowProposer(options, lookup=True)
        may = row.may_propose(known)
        proposals = [RowProposer(options, lookup=True).propose(known + [t], 8) for t in range(12)]
        assert may == any(proposals), (known, may)
    fresh = RowProposer(options, lookup=True)
    assert not fresh.may_propose([5, 6, 7])  # 7 begins no 2-gram yet
    assert fresh.may_propose([5, 6, 7, 5])  # 5 does: (5, 6)


def test_an_idle_batch_times_no_step_across_the_gap() -> None:
    """A verification that ended the last request: the time until the next request's
    first step is not that verification's cost (such a sample, seconds long, priced its
    width out for good)."""
    spec = Speculation(max_rows=None, widest=8)
    for width in (2, 2):
        spec.verified(1, width, time.perf_counter() - 0.01)
        spec.step_begins()
    assert spec.costs.measured(1, 2)
    before = spec.costs.estimate(1, 2)
    spec.verified(1, 2, time.perf_counter() - 30.0)  # as if the idle gap had followed
    spec.clear()  # the batch went idle
    spec.step_begins()
    assert spec.costs.estimate(1, 2) == before


def test_noisy_ordinary_steps_leave_the_width_ratios_alone() -> None:
    """Thousands of ordinary steps with noisy timings (nothing else measured): the price
    of a wider step relative to an ordinary one stays what was measured (it used to
    drift without bound, to 1e80 after 2000 such steps)."""
    rng = random.Random(1)
    learnt = costs({1: {1: 10.0, 2: 13.0}})
    for _ in range(2000):
        learnt.record(1, 1, 10.0 * rng.lognormvariate(0, 0.5))
    assert ratio(learnt) == pytest.approx(1.3, rel=0.1)
