"""Constrained decoding in MlxEngine's batch (qwen3 demo model, random weights)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from pipeserve.constraint import Envelope
from pipeserve.engine.sampling.grammar import GrammarError
from pipeserve.events import TokenText
from pipeserve.request import OutputFormat
from pipeserve.stages.grammar_plan import response_grammar
from tests.engine.helpers import collect, job

pytestmark = pytest.mark.mlx

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "boolean"}},
    "required": ["n", "b"],
    "additionalProperties": False,
}


def grammar(runtime: Any, schema: Any = SCHEMA) -> str:
    return response_grammar(runtime.grammar, OutputFormat("json_schema", schema), Envelope(), False)


def wait_stat(runtime: Any, name: str, value: float) -> float:
    deadline = time.monotonic() + 30
    while (got := runtime.engine.stats()[name]) != value and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def test_every_sampler_follows_the_grammar_in_one_batch(mlx_runtime: Any) -> None:
    runtime = mlx_runtime("qwen3")
    eos = runtime.eos_token_ids
    settings: list[dict[str, Any]] = [
        {"temperature": 0.0},
        {"temperature": 1.0},
        {"temperature": 1.0, "seed": 7},
        {"temperature": 0.8, "top_p": 0.9, "min_p": 0.05},
        {"temperature": 1.0, "top_k": 20},
        {"temperature": 1.0, "presence_penalty": 1.5, "logit_bias": {90: 100.0}},
    ]
    streams = []
    for sampling in settings:
        spec = job([10, 20, 30], max_tokens=60, stop=eos, **sampling)
        spec.constraint = runtime.grammar.constraint(grammar(runtime))
        streams.append(runtime.engine.submit(spec))
    for stream in streams:
        got = collect(stream)
        assert got.finish.reason == "stop"
        value = json.loads("".join(e.text for e in got.events if isinstance(e, TokenText)))
        assert set(value) == {"n", "b"} and 0 <= value["n"] <= 99
    assert wait_stat(runtime, "constrained_sequences", 0) == 0


def test_cancelled_constrained_job_frees_its_rows(mlx_runtime: Any) -> None:
    runtime = mlx_runtime("qwen3")
    open_ended = {"type": "array", "items": {"type": "integer"}, "minItems": 500}
    spec = job([1, 2, 3], max_tokens=2000, temperature=1.0)
    spec.constraint = runtime.grammar.constraint(grammar(runtime, open_ended))
    stream = runtime.engine.submit(spec)
    for i, event in enumerate(stream):
        if isinstance(event, TokenText) and i > 4:
            stream.cancel()
            break
    assert wait_stat(runtime, "constrained_sequences", 0) == 0
    assert wait_stat(runtime, "in_flight", 0) == 0


def test_a_schema_that_does_not_compile_says_why(mlx_runtime: Any) -> None:
    runtime = mlx_runtime("qwen3")
    with pytest.raises(GrammarError, match="pattern|regex"):
        runtime.grammar.constraint(grammar(runtime, {"type": "string", "pattern": "(?<=a)b"}))
