"""A generation job with every field set away from its default: the wire schemas' tests
(the control channel and the engine host) round-trip it, so a field added to
GenerationJob but not to pipeserve/wire_schema.py fails them."""

from __future__ import annotations

from pipeserve.engine.base import GenerationJob, ThinkingLimit
from pipeserve.request import SamplingParams


def full_job() -> GenerationJob:
    """Every field but the constraint (its spec travels beside the job) set."""
    sampling = SamplingParams(0.7, 0.9, 40, 0.05, 1.1, 0.5, -0.5, {7: -100.0, 9: 2.5}, 1234,
                              frozenset({"top_p"}))  # fmt: skip
    thinking = ThinkingLimit(64, (10,), (11,), (11, 12), opened=True)
    return GenerationJob("req-1", [1, 2, 3], sampling, 17, frozenset({2, 5}), True, 3, "mock",
                         2.5, None, ("STOP", "\n\n"), [4, 5], thinking, "group-1", 3,
                         "adapter-1")  # fmt: skip
