"""The plan of one engine step: what the scheduler decided, handed to the generator.

The scheduler (scheduler.py) builds a StepPlan from the requests it holds and calls
`BatchGenerator.step(plan)` (generator.py); nothing else steers a step. How many tokens
each speculating row verifies is not in the plan: it depends on the proposals, which
exist only inside the decode step (speculative/verify.py chooses it there with
speculative/policy.py from the rows' acceptance and the measured step costs).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepPlan:
    prefill_rows: int  # waiting prompts prefilled together this step (at least 1)
    logprobs: bool  # some row asked for log-probabilities: the step normalises its logits


DEFAULT_PLAN = StepPlan(prefill_rows=1, logprobs=True)  # mlx-lm's own step, until planned
