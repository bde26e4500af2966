"""Turn-level shaping of the tool_calls stage: whitespace around calls, which calls count
for the finish reason, and parallel_tool_calls=false."""

from __future__ import annotations

import dataclasses

import pytest

from pipeserve.events import ContentDelta, Finish, PromptReady, TokenText, Usage
from pipeserve.stages.thinking import ThinkingParams, build_thinking
from pipeserve.stages.tool_calls import ToolCallsParams, build_tool_calls

from .helpers import ENV, make_ctx, run, splits, summarize, token_events, without_usage

CALL_W = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_T = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
GLM_T = "<tool_call>get_time\n<arg_key>tz</arg_key>\n<arg_value>CET</arg_value>\n</tool_call>"
KIMI_T = (
    "<|tool_calls_section_begin|>\n<|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>"
    '{"tz": "CET"}<|tool_call_end|>\n<|tool_calls_section_end|>'
)
BAD = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris" "days": 3}}</tool_call>'
W, T = ("call", "get_weather", '{"city": "Paris"}'), ("call", "get_time", '{"tz": "CET"}')


def stage(fmt: str = "json"):
    return build_tool_calls(ToolCallsParams(format=fmt), ENV)


WHITESPACE_CASES = [
    ("between-calls", CALL_W + "\n" + CALL_T, [W, T, ("finish", "tool_calls")]),
    ("between-and-after", CALL_W + "\n\n" + CALL_T + "\n", [W, T, ("finish", "tool_calls")]),
    ("leading", "\n\n" + CALL_W, [W, ("finish", "tool_calls")]),
    (
        "text-after-is-kept",
        CALL_W + "\n\nDone.",
        [W, ("content", "\n\nDone."), ("finish", "tool_calls")],
    ),
    (
        "text-before-is-kept",
        "Checking.\n" + CALL_W,
        [("content", "Checking.\n"), W, ("finish", "tool_calls")],
    ),
    ("inner-space-of-text", "a \n b", [("content", "a \n b"), ("finish", "stop")]),
    ("whitespace-only-answer", "\n \n", [("content", "\n \n"), ("finish", "stop")]),
]


@pytest.mark.parametrize(
    "completion,expected", [c[1:] for c in WHITESPACE_CASES], ids=[c[0] for c in WHITESPACE_CASES]
)
def test_whitespace_around_calls_is_not_content(completion: str, expected: list) -> None:
    for tokens in splits(completion, ("<tool_call>", "</tool_call>")):
        assert without_usage(summarize(run(stage(), token_events(tokens)))) == expected, tokens


@pytest.mark.parametrize("fmt,call", [("glm", GLM_T), ("kimi", KIMI_T)])
def test_whitespace_between_calls_other_formats(fmt: str, call: str) -> None:
    got = without_usage(
        summarize(run(stage(fmt), token_events(list("\n" + call + "\n\n" + call + "\n"))))
    )
    assert got == [T, T, ("finish", "tool_calls")]


def test_whitespace_after_reasoning_before_call_is_dropped() -> None:
    ctx = make_ctx()
    thinking = build_thinking(ThinkingParams(), ENV)
    tools = stage()
    pieces = ["<think>", "hm", "</think>", "\n\n", *CALL_W.split("\n"), "\n"]
    out = list(tools(thinking(iter(token_events(pieces)), ctx), ctx))
    assert without_usage(summarize(out)) == [("reasoning", "hm"), W, ("finish", "tool_calls")]
    assert not any(isinstance(e, ContentDelta) for e in out)


# ------------------------------------------------------------ finish reason of broken calls


def test_malformed_only_call_finishes_stop() -> None:
    completion = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris" "days": 3}}</tool_call>'
    )
    got = without_usage(summarize(run(stage(), token_events([completion]))))
    assert got[-1] == ("finish", "stop")


def test_valid_call_next_to_malformed_one_finishes_tool_calls() -> None:
    bad = BAD
    got = without_usage(summarize(run(stage(), token_events([CALL_T, bad]))))
    assert (
        got[0] == T
        and got[1][2] == '{"city": "Paris""days": 3}'
        and got[-1] == ("finish", "tool_calls")
    )


def test_cut_call_finishes_length() -> None:
    got = without_usage(
        summarize(
            run(
                stage(),
                token_events(
                    [CALL_T, '<tool_call>{"name": "get_weather", "arguments": {"ci'], "length"
                ),
            )
        )
    )
    assert got == [T, ("call", "get_weather", '{"ci'), ("finish", "length")]


# ------------------------------------------------------------ parallel_tool_calls=false


def single_ctx():
    ctx = make_ctx()
    ctx.request = dataclasses.replace(ctx.request, parallel_tool_calls=False)
    return ctx


def cancellable(pieces: list[str], ctx) -> list:
    """A generate stage stand-in that honours ctx.cancel like the real one."""

    def gen():
        yield PromptReady(5)
        for i, piece in enumerate(pieces):
            if ctx.cancelled:
                yield Finish("cancelled")
                yield Usage(5, i)
                return
            yield TokenText(piece, 100 + i)
        yield Finish("stop")
        yield Usage(5, len(pieces))

    return gen()


def test_parallel_false_ends_turn_after_first_call() -> None:
    ctx = single_ctx()
    built = stage()
    built.prepare(ctx)
    pieces = list(CALL_W) + list("\n" + CALL_T + "\nmore text")
    out = list(built(cancellable(pieces, ctx), ctx))
    assert ctx.cancelled and ctx.cancel_reason == "single_tool_call"
    assert summarize(out)[:2] == [W, ("finish", "tool_calls")]
    assert sum(isinstance(e, Usage) for e in out) == 1
    assert summarize(out)[-1][0] == "usage" and summarize(out)[-1][1] < len(pieces)


def test_parallel_false_same_token_second_call_dropped() -> None:
    ctx = single_ctx()
    out = run(stage(), token_events([CALL_W + "\n" + CALL_T]), ctx)
    assert without_usage(summarize(out)) == [W, ("finish", "tool_calls")]


def test_parallel_false_does_not_stop_on_malformed_call() -> None:
    ctx = single_ctx()
    bad = BAD
    got = without_usage(summarize(run(stage(), token_events([bad, CALL_T]), ctx)))
    assert got[0] == (
        "call",
        "get_weather",
        '{"city": "Paris""days": 3}',
    )  # the broken call did not end the turn
    assert got[-2:] == [T, ("finish", "tool_calls")]


def test_parallel_default_keeps_all_calls() -> None:
    ctx = make_ctx()
    got = without_usage(summarize(run(stage(), token_events([CALL_W, CALL_T]), ctx)))
    assert got == [W, T, ("finish", "tool_calls")] and not ctx.cancelled
