"""Each pipelines/*.yaml end to end: the real render, generate (replay engine streaming an
exact completion through the family's real tokenizer), thinking, tool_calls and
stop_sequences stages, built from the validated YAML."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipeserve.config import load_pipeline
from pipeserve.request import GenerationRequest, Message, ToolChoice
from pipeserve.stages.base import BuildEnv, Chain, RequestContext
from tests.families import COMPLETIONS, DEMO, HAS_REASONING, HAS_TEXT, OPENS_THINKING

from .helpers import TOOLS, summarize, without_usage

REPO = Path(__file__).resolve().parents[2]
REASON, CALL = (
    ("reasoning", "Plan: call the tool."),
    ("call", "get_weather", '{"city": "Paris", "days": 2}'),
)

# Each family's answer (tests/families.py) and the events its pipeline must make of it.
CASES = {
    family: (
        COMPLETIONS[family],
        [
            *([REASON] if HAS_REASONING[family] else []),
            *([("content", "Sure.")] if HAS_TEXT[family] else []),
            CALL,
            ("finish", "tool_calls"),
        ],
    )
    for family in COMPLETIONS
}


def run_pipeline(
    runtime: Any, family: str, completion: str, **request: Any
) -> tuple[list, RequestContext]:
    pipeline = load_pipeline(REPO / "pipelines" / f"{family}.yaml")
    env = BuildEnv(model_name="replay", family=family, runtime=runtime)
    chain = Chain(
        [s.spec.factory(s.params, env) for s in pipeline.stages], [s.role for s in pipeline.stages]
    )
    req = GenerationRequest(
        model="replay",
        messages=[Message("user", "Weather in Paris?")],
        tools=TOOLS,
        mock_response=completion,
        **request,
    )
    ctx = RequestContext(request=req, request_id="e2e", model_name="replay")
    chain.prepare(ctx)
    return list(chain.run(ctx)), ctx


@pytest.mark.parametrize("family", sorted(CASES))
def test_pipeline_end_to_end(family: str, replay_runtime: Callable[[str], Any]) -> None:
    completion, expected = CASES[family]
    runtime = replay_runtime(DEMO.get(family, family))
    out, ctx = run_pipeline(runtime, family, completion)
    # GLM's and DeepSeek R1's templates end the prompt with <think>
    assert ctx.prompt_opened_thinking == (family in OPENS_THINKING)
    summary = summarize(out)
    assert without_usage(summary) == expected
    if HAS_REASONING[family]:
        assert summary[-1][2] > 0  # reasoning tokens counted


def test_stop_sequence_cancels_replay(replay_runtime: Callable[[str], Any]) -> None:
    completion = "Hello there END_OF_ANSWER and more text that is never streamed"
    out, ctx = run_pipeline(replay_runtime("qwen3"), "qwen3", completion, stop=["END_OF_ANSWER"])
    assert without_usage(summarize(out)) == [
        ("content", "Hello there "),
        ("finish", "stop", "END_OF_ANSWER"),
    ]
    assert ctx.cancel_reason == "stop_sequence"


@pytest.mark.parametrize("family", ["qwen3", "gpt-oss", "kimi", "glm"])
def test_forced_function_call_end_to_end(family: str, replay_runtime: Callable[[str], Any]) -> None:
    body = {
        "qwen3": '{"city": "Paris", "days": "2"}}\n</tool_call>',
        "gpt-oss": '{"city": "Paris", "days": "2"}<|call|>',
        "kimi": '{"city": "Paris", "days": "2"}<|tool_call_end|><|tool_calls_section_end|>',
        "glm": "<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key>"
        "<arg_value>2</arg_value></tool_call>",
    }[family]
    out, ctx = run_pipeline(
        replay_runtime(family), family, body, tool_choice=ToolChoice("function", "get_weather")
    )
    assert ctx.assistant_prefill
    assert without_usage(summarize(out)) == [CALL, ("finish", "tool_calls")]


def test_gemma_folds_the_system_prompt_into_the_first_user_turn(
    replay_runtime: Callable[[str], Any],
) -> None:
    """Gemma's template refuses a system role; the pipeline's `system_role: fold` puts the
    system text at the start of the first user turn instead."""
    from pipeserve.stages.render_template import fold_system

    pipeline = load_pipeline(REPO / "pipelines" / "gemma.yaml")
    env = BuildEnv(model_name="replay", family="gemma", runtime=replay_runtime("gemma"))
    chain = Chain(
        [s.spec.factory(s.params, env) for s in pipeline.stages], [s.role for s in pipeline.stages]
    )
    messages = [Message("system", "Be brief."), Message("user", "Hi"), Message("user", "Again")]
    req = GenerationRequest(model="replay", messages=messages, mock_response="Hello.")
    ctx = RequestContext(request=req, request_id="fold", model_name="replay")
    chain.prepare(ctx)
    assert "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>" in ctx.prompt
    assert without_usage(summarize(chain.run(ctx))) == [("content", "Hello."), ("finish", "stop")]
    only_system = fold_system(
        [{"role": "system", "content": "A"}, {"role": "developer", "content": "B"}]
    )
    assert only_system == [{"role": "user", "content": "A\n\nB"}]
