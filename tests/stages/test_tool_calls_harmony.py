"""tool_calls format harmony (GPT-OSS), driven with real o200k Harmony token ids."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pipeserve.events import (
    Event,
    Finish,
    PromptReady,
    TokenText,
    ToolCallArgsDelta,
    ToolCallStart,
    Usage,
)
from pipeserve.request import ToolChoice
from pipeserve.stages.tool_calls import ToolCallsParams, build_tool_calls

from .helpers import ENV, make_ctx, run, summarize, without_usage

ANALYSIS = "<|channel|>analysis<|message|>User wants weather and time. Call both.<|end|>"
WEATHER = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris", "days": "3"}<|call|>'
)
TIME = (
    '<|start|>assistant<|channel|>commentary to=functions.get_time<|message|>{"tz":"CET"}<|call|>'
)
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Zürich ☀️.<|return|>"
STOP_TOKENS = ("<|return|>", "<|call|>")  # the engine stops on these and does not emit them


def stage():
    return build_tool_calls(ToolCallsParams(format="harmony"), ENV)


def harmony_events(enc: Any, completion: str, finish: str = "stop") -> list[Event]:
    ids = enc.encode(completion, allowed_special="all")
    if finish == "stop" and enc.decode(ids[-1:]) in STOP_TOKENS:
        ids = ids[:-1]
    tokens = [TokenText(enc.decode([i]), i) for i in ids]
    return [PromptReady(10), *tokens, Finish(finish), Usage(10, len(tokens) + 1)]  # type: ignore[arg-type]


def test_analysis_then_two_function_calls(harmony_encoding: Any) -> None:
    out = run(stage(), harmony_events(harmony_encoding, ANALYSIS + WEATHER + TIME))
    assert without_usage(summarize(out)) == [
        ("reasoning", "User wants weather and time. Call both."),
        ("call", "get_weather", '{"city": "Paris", "days": 3}'),
        ("call", "get_time", '{"tz": "CET"}'),
        ("finish", "tool_calls"),
    ]
    assert sum(isinstance(e, ToolCallArgsDelta) for e in out) > 3  # streamed while generated
    assert out[-1].reasoning_tokens == len(
        harmony_encoding.encode("User wants weather and time. Call both.")
    )


def test_final_channel_is_content(harmony_encoding: Any) -> None:
    out = summarize(run(stage(), harmony_events(harmony_encoding, ANALYSIS + FINAL)))
    assert without_usage(out) == [
        ("reasoning", "User wants weather and time. Call both."),
        ("content", "It is sunny in Zürich ☀️."),
        ("finish", "stop"),
    ]


def test_final_without_analysis_and_explicit_return_token(harmony_encoding: Any) -> None:
    events = harmony_events(
        harmony_encoding, "<|channel|>final<|message|>Hi!<|return|>", finish="length"
    )
    assert without_usage(summarize(run(stage(), events))) == [
        ("content", "Hi!"),
        ("finish", "length"),
    ]


def test_preamble_on_commentary_is_content(harmony_encoding: Any) -> None:
    text = "<|channel|>commentary<|message|>Checking the weather.<|end|>" + WEATHER
    assert without_usage(summarize(run(stage(), harmony_events(harmony_encoding, text)))) == [
        ("content", "Checking the weather."),
        ("call", "get_weather", '{"city": "Paris", "days": 3}'),
        ("finish", "tool_calls"),
    ]


def test_call_cut_off_by_max_tokens(harmony_encoding: Any) -> None:
    text = (
        ANALYSIS
        + '<|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>{"city": "Pa'
    )
    out = summarize(run(stage(), harmony_events(harmony_encoding, text, finish="length")))
    assert without_usage(out) == [
        ("reasoning", "User wants weather and time. Call both."),
        ("call", "get_weather", '{"city": "Pa'),
        ("finish", "length"),
    ]


def test_reasoning_cut_off_by_max_tokens(harmony_encoding: Any) -> None:
    out = summarize(
        run(
            stage(),
            harmony_events(harmony_encoding, "<|channel|>analysis<|message|>Hmm, so", "length"),
        )
    )
    assert without_usage(out) == [("reasoning", "Hmm, so"), ("finish", "length")]


def test_call_in_analysis_channel_and_constrain(harmony_encoding: Any) -> None:
    text = '<|channel|>analysis to=functions.get_time <|constrain|>json<|message|>{"tz": 1}<|call|>'
    out = summarize(run(stage(), harmony_events(harmony_encoding, text)))
    assert without_usage(out) == [("call", "get_time", '{"tz": "1"}'), ("finish", "tool_calls")]


def test_text_that_is_not_harmony_reaches_the_client(harmony_encoding: Any) -> None:
    out = summarize(run(stage(), harmony_events(harmony_encoding, "Hello world, plain text.")))
    assert without_usage(out) == [("content", "Hello world, plain text."), ("finish", "stop")]
    mixed = ANALYSIS + "stray words<|start|>assistant<|channel|>final<|message|>ok"
    out = summarize(run(stage(), harmony_events(harmony_encoding, mixed)))
    assert without_usage(out) == [
        ("reasoning", "User wants weather and time. Call both."),
        ("content", "stray wordsok"),
        ("finish", "stop"),
    ]


@pytest.mark.parametrize(
    "mode,prefill",
    [
        ("function", "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>"),
        ("required", "<|channel|>commentary to=functions."),
    ],
)
def test_forced_call_prefill(harmony_encoding: Any, mode: str, prefill: str) -> None:
    ctx = make_ctx(tool_choice=ToolChoice(mode, "get_time" if mode == "function" else None))
    built = stage()
    built.prepare(ctx)
    assert ctx.assistant_prefill == prefill
    rest = '{"tz": "UTC"}' if mode == "function" else 'get_time<|message|>{"tz": "UTC"}'
    out = list(built(iter(harmony_events(harmony_encoding, rest)), ctx))
    if mode == "function":
        assert isinstance(out[0], ToolCallStart)  # before any generated token
    assert without_usage(summarize(out)) == [
        ("call", "get_time", '{"tz": "UTC"}'),
        ("finish", "tool_calls"),
    ]


def test_tool_choice_none_keeps_channels_and_makes_calls_text(harmony_encoding: Any) -> None:
    ctx = make_ctx(tool_choice=ToolChoice("none"))
    out = summarize(run(stage(), harmony_events(harmony_encoding, ANALYSIS + WEATHER), ctx))
    assert without_usage(out) == [
        ("reasoning", "User wants weather and time. Call both."),
        ("content", '{"city": "Paris", "days": "3"}'),
        ("finish", "stop"),
    ]


def test_arguments_parse_as_json(harmony_encoding: Any) -> None:
    text = (
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Zürich", "hours": ["1", "2"], "options": "{\\"hourly\\": true}"}'
    )
    out = summarize(run(stage(), harmony_events(harmony_encoding, text)))
    assert json.loads(out[0][2]) == {"city": "Zürich", "hours": [1, 2], "options": {"hourly": True}}
