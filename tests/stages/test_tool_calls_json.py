"""tool_calls format json (Qwen / Hermes): token texts in, events out."""

from __future__ import annotations

import json

import pytest

from pipeserve.events import ToolCallArgsDelta, ToolCallEnd, ToolCallStart
from pipeserve.request import ToolChoice
from pipeserve.stages.thinking import ThinkingParams, build_thinking
from pipeserve.stages.tool_calls import ToolCallsParams, build_tool_calls

from .helpers import ENV, args, make_ctx, run, splits, summarize, token_events, without_usage

MARKERS = ("<tool_call>", "</tool_call>")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": "3"}}\n</tool_call>'
PARIS = '{"city": "Paris", "days": 3}'


def stage():
    return build_tool_calls(ToolCallsParams(format="json"), ENV)


CASES = [
    (
        "text-call-text",
        "Let me check. " + CALL + "\nDone.",
        [
            ("content", "Let me check. "),
            ("call", "get_weather", PARIS),
            ("content", "\nDone."),
            ("finish", "tool_calls"),
        ],
    ),
    (
        "two-calls",
        CALL + "\n" + '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
        [
            ("call", "get_weather", PARIS),
            ("call", "get_time", '{"tz": "CET"}'),
            ("finish", "tool_calls"),
        ],
    ),
    ("plain", "No tools needed.", [("content", "No tools needed."), ("finish", "stop")]),
    (
        "not-json",
        'x <tool_call>get_weather(city="Paris")</tool_call> y',
        [("content", 'x <tool_call>get_weather(city="Paris")</tool_call> y'), ("finish", "stop")],
    ),
    (
        "broken-json",
        '<tool_call>{"name": "get_weather", "argu</tool_call>',
        [("content", '<tool_call>{"name": "get_weather", "argu</tool_call>'), ("finish", "stop")],
    ),
    (
        "keys-reordered",
        '<tool_call>{"arguments": {"days": "2", "city": "Oslo"}, "name": "get_weather"}</tool_call>',
        [("call", "get_weather", '{"days": 2, "city": "Oslo"}'), ("finish", "tool_calls")],
    ),
    (
        "list-of-calls",
        '<tool_call>[{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {"tz": "UTC"}}]</tool_call>',
        [
            ("call", "get_time", "{}"),
            ("call", "get_time", '{"tz": "UTC"}'),
            ("finish", "tool_calls"),
        ],
    ),
    (
        "stringified-arguments",
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\", \\"days\\": \\"1\\"}"}</tool_call>',
        [("call", "get_weather", '{"city": "Rome", "days": 1}'), ("finish", "tool_calls")],
    ),
    (
        "unicode",
        '答えは<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich 東京 🙂", "note": "l\\u00e4uft"}}</tool_call>🙂',
        [
            ("content", "答えは"),
            ("call", "get_weather", '{"city": "Zürich 東京 🙂", "note": "l\\u00e4uft"}'),
            ("content", "🙂"),
            ("finish", "tool_calls"),
        ],
    ),
    (
        "missing-outer-brace",
        '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}</tool_call>',
        [("call", "get_time", '{"tz": "CET"}'), ("finish", "tool_calls")],
    ),
    (
        "missing-args-brace",
        '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"</tool_call>',
        [("call", "get_time", '{"tz": "CET"}'), ("finish", "tool_calls")],
    ),
    (
        "complete-json-no-end-marker",
        '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}',
        [("call", "get_time", '{"tz": "CET"}'), ("finish", "tool_calls")],
    ),
    (
        "unknown-tool-uncoerced",
        '<tool_call>{"name": "other", "arguments": {"n": "3"}}</tool_call>',
        [("call", "other", '{"n": "3"}'), ("finish", "tool_calls")],
    ),
    (
        "marker-lookalike",
        "a <tool_calls> b </tool_call",
        [("content", "a <tool_calls> b </tool_call"), ("finish", "stop")],
    ),
]


@pytest.mark.parametrize("completion,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_json_every_split(completion: str, expected: list) -> None:
    built = stage()
    for tokens in splits(completion, MARKERS):
        assert without_usage(summarize(run(built, token_events(tokens)))) == expected, tokens


def test_coercion_to_schema_types() -> None:
    body = {
        "city": 42,
        "days": "3",
        "metric": "true",
        "ratio": "0.5",
        "options": '{"hourly": "false"}',
        "hours": ["1", 2, "3"],
        "note": None,
        "extra": "7",
    }
    text = "<tool_call>" + json.dumps({"name": "get_weather", "arguments": body}) + "</tool_call>"
    for tokens in splits(text, MARKERS):
        (got,) = args(summarize(run(stage(), token_events(tokens))))
        assert got == {
            "city": "42",
            "days": 3,
            "metric": True,
            "ratio": 0.5,
            "options": {"hourly": False},
            "hours": [1, 2, 3],
            "note": None,
            "extra": "7",
        }


def test_arguments_stream_as_fragments_while_generated() -> None:
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": "3", "note": "a long note"}}</tool_call>'
    tokens = [text[i : i + 4] for i in range(0, len(text), 4)]
    out = run(stage(), token_events(tokens))
    kinds = [type(e) for e in out]
    start, end = kinds.index(ToolCallStart), kinds.index(ToolCallEnd)
    fragments = [e.fragment for e in out[start:end] if isinstance(e, ToolCallArgsDelta)]
    assert len(fragments) > 5  # streamed, not one blob
    assert "".join(fragments) == out[end].arguments
    assert json.loads(out[end].arguments) == {"city": "Paris", "days": 3, "note": "a long note"}


def test_truncated_before_name_is_text() -> None:
    completion = 'Hi <tool_call>\n{"name": "get_wea'
    for tokens in splits(completion, MARKERS):
        got = without_usage(summarize(run(stage(), token_events(tokens, finish="length"))))
        assert got == [("content", completion), ("finish", "length")]


def test_truncated_inside_arguments_keeps_every_character() -> None:
    completion = 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    for tokens in splits(completion, MARKERS):
        got = without_usage(summarize(run(stage(), token_events(tokens, finish="length"))))
        assert got == [
            ("content", "Hi "),
            ("call", "get_weather", '{"city": "Par'),
            ("finish", "length"),
        ]
    held = without_usage(
        summarize(run(stage(), token_events([completion, 'is", "days": "1'], finish="length")))
    )
    assert held[1] == (
        "call",
        "get_weather",
        '{"city": "Paris", "days": "1',
    )  # held value flushed raw


def test_malformed_arguments_after_start_degrade_to_raw_text() -> None:
    completion = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris" "days": 3}}</tool_call> ok'
    got = without_usage(summarize(run(stage(), token_events([completion]))))
    assert got == [
        ("call", "get_weather", '{"city": "Paris""days": 3}'),
        ("content", " ok"),
        ("finish", "stop"),
    ]


def test_tool_choice_none_passes_text_through() -> None:
    ctx = make_ctx(tool_choice=ToolChoice("none"))
    got = without_usage(summarize(run(stage(), token_events([CALL]), ctx)))
    assert got == [("content", CALL), ("finish", "stop")]


def test_tool_choice_required_prefills_and_parses() -> None:
    ctx = make_ctx(tool_choice=ToolChoice("required"))
    built = stage()
    built.prepare(ctx)
    assert ctx.assistant_prefill == "<tool_call>\n"
    tokens = ['{"name": "get_time", ', '"arguments": {"tz": "CET"}}\n</tool_call>']
    got = without_usage(summarize(built(iter(token_events(tokens)), ctx)))
    assert got == [("call", "get_time", '{"tz": "CET"}'), ("finish", "tool_calls")]


def test_tool_choice_function_prefills_name_and_streams_arguments() -> None:
    ctx = make_ctx(tool_choice=ToolChoice("function", "get_weather"))
    built = stage()
    built.prepare(ctx)
    assert ctx.assistant_prefill == '<tool_call>\n{"name": "get_weather", "arguments": '
    out = list(
        built(iter(token_events(['{"city": "Oslo",', ' "days": "2"}}', "</tool_call>"])), ctx)
    )
    assert (
        isinstance(out[1], ToolCallStart) and out[1].name == "get_weather"
    )  # right after PromptReady
    assert without_usage(summarize(out)) == [
        ("call", "get_weather", '{"city": "Oslo", "days": 2}'),
        ("finish", "tool_calls"),
    ]


def test_forced_call_closes_think_block_opened_by_prompt() -> None:
    ctx = make_ctx(tool_choice=ToolChoice("required"), opened_thinking=True)
    thinking = build_thinking(ThinkingParams(), ENV)
    built = stage()
    thinking.prepare(ctx)
    built.prepare(ctx)
    assert ctx.assistant_prefill == "</think>\n\n<tool_call>\n"
    assert ctx.prompt_opened_thinking is False
    events = thinking(
        iter(token_events(['{"name": "get_time", "arguments": {}}</tool_call>'])), ctx
    )
    assert without_usage(summarize(built(events, ctx))) == [
        ("call", "get_time", "{}"),
        ("finish", "tool_calls"),
    ]


def test_custom_markers_from_params() -> None:
    built = build_tool_calls(ToolCallsParams(format="json", start="[TOOL]", end="[/TOOL]"), ENV)
    for tokens in splits(
        'a[TOOL]{"name": "get_time", "arguments": {}}[/TOOL]b', ("[TOOL]", "[/TOOL]")
    ):
        assert without_usage(summarize(run(built, token_events(tokens)))) == [
            ("content", "a"),
            ("call", "get_time", "{}"),
            ("content", "b"),
            ("finish", "tool_calls"),
        ]


def test_ids_are_unique_across_requests() -> None:
    ids = set()
    for _ in range(50):
        out = run(stage(), token_events([CALL]))
        ids.update(e.id for e in out if isinstance(e, ToolCallStart))
    assert len(ids) == 50
