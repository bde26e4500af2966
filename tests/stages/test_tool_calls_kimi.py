"""tool_calls format kimi: sectioned calls with `functions.NAME:IDX` ids and JSON arguments."""

from __future__ import annotations

import pytest

from pipeserve.events import ToolCallArgsDelta
from pipeserve.request import ToolChoice
from pipeserve.stages.tool_calls import ToolCallsParams, build_tool_calls

from .helpers import ENV, make_ctx, run, splits, summarize, token_events, without_usage

SEC, SEC_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL, ARG, END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
MARKERS = (SEC, SEC_END, CALL, ARG, END)


def stage():
    return build_tool_calls(ToolCallsParams(format="kimi"), ENV)


def call(name: str, idx: int, body: str) -> str:
    return f"{CALL}functions.{name}:{idx}{ARG}{body}{END}"


CASES = [
    (
        "one-call",
        "I'll check." + SEC + call("get_weather", 0, '{"city": "Paris", "days": "3"}') + SEC_END,
        [
            ("content", "I'll check."),
            ("call", "get_weather", '{"city": "Paris", "days": 3}'),
            ("finish", "tool_calls"),
        ],
    ),
    (
        "two-calls",
        SEC
        + call("get_time", 0, '{"tz": "CET"}')
        + "\n"
        + call("get_weather", 1, '{"city": "Oslo"}')
        + SEC_END,
        [
            ("call", "get_time", '{"tz": "CET"}'),
            ("call", "get_weather", '{"city": "Oslo"}'),
            ("finish", "tool_calls"),
        ],
    ),
    (
        "text-after-section",
        SEC + call("get_time", 0, "{}") + SEC_END + " done",
        [("call", "get_time", "{}"), ("content", " done"), ("finish", "tool_calls")],
    ),
    (
        "call-without-section",
        call("get_time", 3, '{"tz": "UTC"}'),
        [("call", "get_time", '{"tz": "UTC"}'), ("finish", "tool_calls")],
    ),
    (
        "no-functions-prefix",
        SEC + CALL + " get_time:0 " + ARG + "{}" + END + SEC_END,
        [("call", "get_time", "{}"), ("finish", "tool_calls")],
    ),
    (
        "coercion",
        SEC
        + call("get_weather", 0, '{"metric": "false", "hours": "[1, 2]", "options": {"hourly": 1}}')
        + SEC_END,
        [
            ("call", "get_weather", '{"metric": false, "hours": [1, 2], "options": {"hourly": 1}}'),
            ("finish", "tool_calls"),
        ],
    ),
    (
        "unicode",
        "🙂" + SEC + call("get_weather", 0, '{"city": "Kraków ✓"}') + SEC_END,
        [
            ("content", "🙂"),
            ("call", "get_weather", '{"city": "Kraków ✓"}'),
            ("finish", "tool_calls"),
        ],
    ),
    (
        "malformed-json-args",
        SEC + call("get_time", 0, '{"tz": CET UTC}') + SEC_END,
        [("call", "get_time", '{"tz": "CET"UTC}'), ("finish", "stop")],
    ),
    (
        "bad-id-is-text",
        SEC + CALL + "<>" + ARG + "{}" + END + SEC_END,
        [("content", SEC + CALL + "<>" + ARG + "{}" + END), ("finish", "stop")],
    ),
]


@pytest.mark.parametrize("completion,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_kimi_every_split(completion: str, expected: list) -> None:
    built = stage()
    for tokens in splits(completion, MARKERS):
        assert without_usage(summarize(run(built, token_events(tokens)))) == expected, tokens


def test_unclosed_in_id_is_text_and_in_arguments_is_partial_call() -> None:
    in_id = "x" + SEC + CALL + "functions.get_wea"
    for tokens in splits(in_id, MARKERS):
        got = without_usage(summarize(run(stage(), token_events(tokens, finish="length"))))
        assert got == [("content", in_id), ("finish", "length")]
    in_args = (
        SEC
        + call("get_time", 0, '{"tz": "CET"}')
        + CALL
        + "functions.get_weather:1"
        + ARG
        + '{"city": "Ber'
    )
    got = without_usage(summarize(run(stage(), token_events([in_args], finish="length"))))
    assert got == [
        ("call", "get_time", '{"tz": "CET"}'),
        ("call", "get_weather", '{"city": "Ber'),
        ("finish", "length"),
    ]


def test_arguments_stream() -> None:
    text = (
        SEC
        + call("get_weather", 0, '{"city": "San Francisco", "note": "bring an umbrella"}')
        + SEC_END
    )
    out = run(stage(), token_events([text[i : i + 3] for i in range(0, len(text), 3)]))
    assert sum(isinstance(e, ToolCallArgsDelta) for e in out) > 5


def test_named_prefill() -> None:
    ctx = make_ctx(tool_choice=ToolChoice("function", "get_time"))
    built = stage()
    built.prepare(ctx)
    assert ctx.assistant_prefill == SEC + CALL + "functions.get_time:0" + ARG
    got = without_usage(
        summarize(built(iter(token_events(['{"tz":', ' "UTC"}', END, SEC_END])), ctx))
    )
    assert got == [("call", "get_time", '{"tz": "UTC"}'), ("finish", "tool_calls")]
