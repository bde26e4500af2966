"""tool_calls format glm: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...`."""

from __future__ import annotations

import pytest

from pipeserve.request import ToolChoice
from pipeserve.stages.tool_calls import ToolCallsParams, build_tool_calls

from .helpers import ENV, make_ctx, run, splits, summarize, token_events, without_usage

MARKERS = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")


def stage():
    return build_tool_calls(ToolCallsParams(format="glm"), ENV)


CASES = [
    (
        "glm45-newlines",
        "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
        [
            ("content", "Checking.\n"),
            ("call", "get_weather", '{"city": "Paris", "days": 3}'),
            ("finish", "tool_calls"),
        ],
    ),
    (
        "glm47-compact",
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>after",
        [
            ("call", "get_weather", '{"city": "Oslo"}'),
            ("content", "after"),
            ("finish", "tool_calls"),
        ],
    ),
    (
        "missing-arg-value-end",
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome<arg_key>days</arg_key>"
        "<arg_value>2</tool_call>",
        [("call", "get_weather", '{"city": "Rome", "days": 2}'), ("finish", "tool_calls")],
    ),
    (
        "whitespace-between",
        "<tool_call>get_weather\n<arg_key> city </arg_key>  \n <arg_value>Lima</arg_value>\n\n</tool_call>",
        [("call", "get_weather", '{"city": "Lima"}'), ("finish", "tool_calls")],
    ),
    (
        "json-values",
        '<tool_call>get_weather<arg_key>options</arg_key><arg_value>{"hourly": "true"}</arg_value>'
        '<arg_key>hours</arg_key><arg_value>[1, "2"]</arg_value><arg_key>metric</arg_key><arg_value>false</arg_value>'
        "<arg_key>ratio</arg_key><arg_value>1.5</arg_value><arg_key>city</arg_key><arg_value>123</arg_value></tool_call>",
        [
            (
                "call",
                "get_weather",
                '{"options": {"hourly": true}, "hours": [1, 2], "metric": false, "ratio": 1.5, "city": "123"}',
            ),
            ("finish", "tool_calls"),
        ],
    ),
    (
        "string-keeps-json-text",
        '<tool_call>get_time<arg_key>tz</arg_key><arg_value>{"a": 1}</arg_value></tool_call>',
        [("call", "get_time", '{"tz": "{\\"a\\": 1}"}'), ("finish", "tool_calls")],
    ),
    (
        "multiline-string",
        "<tool_call>get_time<arg_key>tz</arg_key><arg_value>\nline1\nline2\n</arg_value></tool_call>",
        [("call", "get_time", '{"tz": "line1\\nline2"}'), ("finish", "tool_calls")],
    ),
    (
        "no-arguments",
        "<tool_call>get_time</tool_call>",
        [("call", "get_time", "{}"), ("finish", "tool_calls")],
    ),
    (
        "two-calls",
        "<tool_call>get_time<arg_key>tz</arg_key><arg_value>CET</arg_value></tool_call>\n"
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Bern</arg_value></tool_call>",
        [
            ("call", "get_time", '{"tz": "CET"}'),
            ("call", "get_weather", '{"city": "Bern"}'),
            ("finish", "tool_calls"),
        ],
    ),
    (
        "unknown-tool-json-guess",
        "<tool_call>other<arg_key>n</arg_key><arg_value>3</arg_value>"
        "<arg_key>s</arg_key><arg_value>text</arg_value></tool_call>",
        [("call", "other", '{"n": 3, "s": "text"}'), ("finish", "tool_calls")],
    ),
    (
        "unicode",
        "天気<tool_call>get_weather<arg_key>city</arg_key><arg_value>東京 🙂</arg_value></tool_call>",
        [
            ("content", "天気"),
            ("call", "get_weather", '{"city": "東京 🙂"}'),
            ("finish", "tool_calls"),
        ],
    ),
    (
        "malformed-is-text",
        '<tool_call>{"name": "x"}</tool_call>',
        [("content", '<tool_call>{"name": "x"}</tool_call>'), ("finish", "stop")],
    ),
    (
        "garbage-after-name",
        "<tool_call>get_time junk <arg_value>x</arg_value></tool_call>",
        [
            ("content", "<tool_call>get_time junk <arg_value>x</arg_value></tool_call>"),
            ("finish", "stop"),
        ],
    ),
]


@pytest.mark.parametrize("completion,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_glm_every_split(completion: str, expected: list) -> None:
    built = stage()
    for tokens in splits(completion, MARKERS):
        assert without_usage(summarize(run(built, token_events(tokens)))) == expected, tokens


@pytest.mark.parametrize("finish", ["length", "stop"])
def test_unclosed_call_is_delivered_as_text(finish: str) -> None:
    completion = "Sure.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Par"
    for tokens in splits(completion, MARKERS):
        got = without_usage(summarize(run(stage(), token_events(tokens, finish=finish))))
        assert got == [("content", completion), ("finish", finish)]


def test_required_and_named_prefill() -> None:
    ctx = make_ctx(tool_choice=ToolChoice("function", "get_time"))
    built = stage()
    built.prepare(ctx)
    assert ctx.assistant_prefill == "<tool_call>get_time\n"
    tokens = ["<arg_key>tz</arg_key>", "<arg_value>UTC</arg_value>", "</tool_call>"]
    got = without_usage(summarize(built(iter(token_events(tokens)), ctx)))
    assert got == [("call", "get_time", '{"tz": "UTC"}'), ("finish", "tool_calls")]
