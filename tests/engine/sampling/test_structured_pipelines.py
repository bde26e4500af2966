"""Structured output through each shipped pipeline on its real MLX demo model (random
weights, temperature 1.0): the family's real render, generate (grammar enforced in the
engine's batch), thinking and tool_calls stages, built from the validated YAML (here,
next to the engine tests, to share their session-wide demo engines).

Forced tool calls must come out as a valid call in the family's own format (the
tool_calls stage parses it) with schema-valid arguments; with reasoning on, the
constraint starts after the reasoning (the close marker gets a logit bias so a random
model closes it soon; the grammar alone decides what follows).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from pipeserve.config import load_pipeline
from pipeserve.context import RequestContext
from pipeserve.request import (
    GenerationRequest,
    Message,
    OutputFormat,
    ReasoningOptions,
    SamplingParams,
    ToolChoice,
    ToolSpec,
)
from pipeserve.stages.base import BuildEnv, Chain
from tests.stages.helpers import summarize, without_usage

pytestmark = pytest.mark.mlx

REPO = Path(__file__).resolve().parents[3]
FAMILIES = ["qwen3", "glm", "kimi", "gpt-oss"]
# The tool-call families (issue 36): forced and strict calls in each one's own format.
TOOL_FAMILIES = ["llama3", "mistral", "qwen3-coder", "deepseek", "phi4", "granite", "gemma"]
ARGS = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "hourly": {"type": "boolean"},
    },
    "required": ["city", "days", "code"],
    "additionalProperties": False,
}
TOOLS = [
    ToolSpec("get_weather", "Weather for a city", ARGS),
    ToolSpec("get_time", "Time in a zone", {
        "type": "object",
        "properties": {"tz": {"enum": ["UTC", "CET"]}},
        "required": ["tz"],
        "additionalProperties": False,
    }),
]  # fmt: skip
ANSWER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[a-z]{2}[0-9]$"},
        "items": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "items", "ok"],
    "additionalProperties": False,
}
# The marker that ends reasoning, per family (biased so a random model reaches it).
REASONING_CLOSE = {"qwen3": "</think>", "glm": "</think>", "kimi": "</think>", "gpt-oss": "<|end|>"}
REASONING_CLOSE.update({"mistral": "[/THINK]", "deepseek": "</think>"})


def run(runtime: Any, family: str, **fields: Any) -> list[tuple[Any, ...]]:
    pipeline = load_pipeline(REPO / "pipelines" / f"{family}.yaml")
    env = BuildEnv(model_name="s", family=family, runtime=runtime)
    chain = Chain(
        [s.spec.factory(s.params, env) for s in pipeline.stages], [s.role for s in pipeline.stages]
    )
    fields.setdefault("max_tokens", 160)
    request = GenerationRequest(
        model="s", messages=[Message("user", "Weather in Paris?")], **fields
    )
    ctx = RequestContext(request=request, request_id="s", model_name="s")
    chain.prepare(ctx)
    return without_usage(summarize(chain.run(ctx)))


def token_id(runtime: Any, marker: str) -> int:
    (token,) = runtime.grammar.encode(marker)
    return int(token)


@pytest.mark.parametrize("family", FAMILIES + TOOL_FAMILIES)
def test_forced_calls_are_valid_in_every_format(
    family: str, mlx_runtime: Callable[[str], Any]
) -> None:
    runtime = mlx_runtime(family)
    choices = [ToolChoice("function", "get_weather"), ToolChoice("required")]

    def ask(choice: ToolChoice) -> list[tuple[Any, ...]]:
        return run(
            runtime, family, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
            reasoning=ReasoningOptions(enabled=False),
        )  # fmt: skip

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(ask, choices))
    for choice, summary in zip(choices, results):
        calls = [item for item in summary if item[0] == "call"]
        assert summary[-1] == ("finish", "tool_calls"), summary
        assert len(calls) == 1, summary
        _, name, arguments = calls[0]
        if choice.mode == "function":
            assert name == "get_weather"
        schema = next(t.parameters for t in TOOLS if t.name == name)
        jsonschema.validate(json.loads(arguments), schema)


@pytest.mark.parametrize("family", FAMILIES)
def test_answer_follows_schema_after_reasoning(
    family: str, mlx_runtime: Callable[[str], Any]
) -> None:
    runtime = mlx_runtime(family)
    close = token_id(runtime, REASONING_CLOSE[family])
    summary = run(
        runtime, family,
        output_format=OutputFormat("json_schema", ANSWER),
        # seeded: unseeded, a random model now and then reasoned past max_tokens (CI saw it)
        sampling=SamplingParams(temperature=1.0, logit_bias={close: 12.0}, seed=7),
        max_tokens=200,
    )  # fmt: skip
    assert summary[-1] == ("finish", "stop"), summary
    content = "".join(item[1] for item in summary if item[0] == "content")
    jsonschema.validate(json.loads(content), ANSWER)


# The token that starts a call, per family (biased so a random model calls often).
CALL_START = {
    "qwen3": "<tool_call>",
    "glm": "<tool_call>",
    "kimi": "<|tool_calls_section_begin|>",
    "gpt-oss": "commentary",  # Harmony: the call is a commentary message
    "llama3": "<|python_tag|>",
    "mistral": "[TOOL_CALLS]",
    "qwen3-coder": "<tool_call>",
    "deepseek": "<｜tool▁calls▁begin｜>",
    "phi4": "<|tool_call|>",
    "granite": "<|tool_call|>",
    "gemma": "```json",  # plain text
}
# Requests per family: one batch in CI; PIPESERVE_STRICT_SAMPLES=48 for a longer run.
STRICT_SAMPLES = int(os.environ.get("PIPESERVE_STRICT_SAMPLES", "6"))
STRICT_TOOLS = [
    ToolSpec("weather", "Weather for a city", ARGS, strict=True),
    ToolSpec("clock", "Time in a zone", {"type": "object"}),  # not strict: any object
]


def complete_calls(summary: list[tuple[Any, ...]]) -> list[tuple[str, Any]]:
    """(name, parsed arguments) of every call; a call cut by max_tokens is left out."""
    calls = [(item[1], item[2]) for item in summary if item[0] == "call"]
    if summary[-1] == ("finish", "length") and calls:
        calls.pop()  # the last call may be the one max_tokens cut
    return [(name, json.loads(arguments)) for name, arguments in calls]


@pytest.mark.parametrize("family", FAMILIES + TOOL_FAMILIES)
def test_strict_tools_under_auto_get_valid_arguments(
    family: str, mlx_runtime: Callable[[str], Any]
) -> None:
    """tool_choice auto, reasoning on, temperature 1.0: the model writes what it likes
    (reasoning, text, calls), and every call to the strict tool validates against its
    schema, every other call is a JSON object. Without the grammar a random model's
    call would be garbage the parser cannot read, so no call would come out."""
    runtime = mlx_runtime(family)
    # Each token of the call start more than the one before (gemma's ``` then json).
    starts = runtime.grammar.encode(CALL_START[family])
    strict_name = runtime.grammar.encode("weather")[0]  # and prefer the strict tool
    bias = {int(token): 30.0 + 10.0 * i for i, token in enumerate(starts)}
    bias[int(strict_name)] = 12.0
    if family in REASONING_CLOSE:
        bias[token_id(runtime, REASONING_CLOSE[family])] = 12.0

    def ask(i: int) -> list[tuple[Any, ...]]:
        mixed = i % 2 == 1  # odd: both tools, parallel calls; even: the strict one, one call
        return run(
            runtime, family, tools=STRICT_TOOLS if mixed else STRICT_TOOLS[:1], max_tokens=96,
            parallel_tool_calls=mixed, sampling=SamplingParams(temperature=1.0, logit_bias=bias),
        )  # fmt: skip

    with ThreadPoolExecutor(6) as pool:
        summaries = list(pool.map(ask, range(STRICT_SAMPLES)))
    calls = [call for summary in summaries for call in complete_calls(summary)]
    strict_calls = [arguments for name, arguments in calls if name == "weather"]
    assert strict_calls, summaries  # the grammar makes started calls complete and readable
    for arguments in strict_calls:
        jsonschema.validate(arguments, ARGS)
    assert all(isinstance(arguments, dict) for _, arguments in calls), calls
    print(f"{family}: {len(summaries)} answers, {len(calls)} calls, {len(strict_calls)} strict")
