"""stop_sequences: stop strings removed even across tokens, never a leaked prefix."""

from __future__ import annotations

from typing import Any

import pytest

from pipeserve.events import (
    ContentDelta,
    Event,
    Finish,
    PromptReady,
    ReasoningDelta,
    TokenText,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from pipeserve.stages.stop_sequences import StopSequencesParams, build_stop_sequences
from pipeserve.stages.thinking import ThinkingParams, build_thinking
from pipeserve.stages.tool_calls import ToolCallsParams, build_tool_calls

from .helpers import ENV, make_ctx, splits, summarize, without_usage


def content_events(texts: list[str], finish: str = "stop") -> list[Event]:
    return [PromptReady(3), *(ContentDelta(t) for t in texts), Finish(finish), Usage(3, len(texts))]


def run_stop(
    texts: list[str], stop: list[str], finish: str = "stop", **params: Any
) -> tuple[list, Any]:
    ctx = make_ctx(stop=stop)
    stage = build_stop_sequences(StopSequencesParams(**params), ENV)
    stage.prepare(ctx)
    out = list(stage(iter(content_events(texts, finish)), ctx))
    return out, ctx


CASES = [
    (
        "match-middle",
        "Hello STOP world",
        ["STOP"],
        [("content", "Hello "), ("finish", "stop", "STOP")],
    ),
    ("no-match", "Hello world", ["STOP"], [("content", "Hello world"), ("finish", "stop")]),
    (
        "partial-then-mismatch",
        "a ST b STO c",
        ["STOP"],
        [("content", "a ST b STO c"), ("finish", "stop")],
    ),
    (
        "prefix-at-end-flushed",
        "ends with ST",
        ["STOP"],
        [("content", "ends with ST"), ("finish", "stop")],
    ),
    (
        "earliest-of-several",
        "x END y ###",
        ["###", "END"],
        [("content", "x "), ("finish", "stop", "END")],
    ),
    ("overlapping", "aab", ["ab"], [("content", "a"), ("finish", "stop", "ab")]),
    ("at-start", "STOPafter", ["STOP"], [("finish", "stop", "STOP")]),
    (
        "unicode",
        "日本語の停止語です",
        ["停止"],
        [("content", "日本語の"), ("finish", "stop", "停止")],
    ),
    (
        "newlines",
        "line1\n\nHuman: hi",
        ["\n\nHuman:"],
        [("content", "line1"), ("finish", "stop", "\n\nHuman:")],
    ),
]


@pytest.mark.parametrize("text,stop,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_stop_every_split(text: str, stop: list[str], expected: list) -> None:
    for tokens in splits(text, stop):
        out, ctx = run_stop(tokens, stop)
        assert without_usage(summarize(out)) == expected, tokens
        assert ctx.cancelled == (len(expected[-1]) == 3)
        assert out[-1] == Usage(3, len(tokens))  # usage passes on, the upstream Finish is swallowed


def test_cancel_reason_and_swallowed_upstream_finish() -> None:
    out, ctx = run_stop(["abc ST", "OP never", " seen"], ["STOP"], finish="cancelled")
    assert ctx.cancel_reason == "stop_sequence"
    assert [type(e) for e in out] == [PromptReady, ContentDelta, Finish, Usage]
    assert out[2] == Finish("stop", stop_sequence="STOP")


def test_without_stop_strings_is_a_passthrough() -> None:
    events = content_events(["a", "b"])
    stage = build_stop_sequences(StopSequencesParams(), ENV)
    assert list(stage(iter(events), make_ctx())) == events


def test_held_prefix_flushed_before_tool_call_and_args_not_scanned() -> None:
    events: list[Event] = [
        ContentDelta("text ST"),
        ToolCallStart(0, "call_x", "f"),
        ToolCallArgsDelta(0, '{"a": "STOP"}'),
        ToolCallEnd(0, '{"a": "STOP"}'),
        Finish("tool_calls"),
        Usage(1, 2),
    ]
    stage = build_stop_sequences(StopSequencesParams(), ENV)
    ctx = make_ctx(stop=["STOP"])
    out = list(stage(iter(events), ctx))
    assert out == [ContentDelta("text "), ContentDelta("ST"), *events[1:]]
    assert not ctx.cancelled


def test_reasoning_scanned_only_when_asked() -> None:
    events: list[Event] = [
        ReasoningDelta("think STOP"),
        ContentDelta("answer"),
        Finish("stop"),
        Usage(1, 2),
    ]
    stage = build_stop_sequences(StopSequencesParams(), ENV)
    assert list(stage(iter(events), make_ctx(stop=["STOP"]))) == events
    scanning = build_stop_sequences(StopSequencesParams(include_reasoning=True), ENV)
    out = list(scanning(iter(events), make_ctx(stop=["STOP"])))
    assert out == [ReasoningDelta("think "), Finish("stop", "STOP"), Usage(1, 2)]


def test_qwen3_multi_token_stop_never_leaks_a_prefix() -> None:
    """A stop string the real Qwen3 tokenizer splits into 4 tokens, through the qwen3 stages."""
    from pipeserve.engine.weights.demo.families import FAMILIES
    from pipeserve.engine.weights.demo.vocab import build_tokenizer
    from pipeserve.settings import pipeserve_home

    spec = FAMILIES["qwen3"]
    tokenizer = build_tokenizer(spec.vocab, spec.specials(), pipeserve_home() / "cache")
    stop = "END_OF_ANSWER"
    completion = "<think>\nok\n</think>\n\nThe answer is 42.END_OF_ANSWER and then more text"
    ids = tokenizer.encode(completion, add_special_tokens=False).ids
    assert len(tokenizer.encode(stop, add_special_tokens=False).ids) >= 3
    events: list[Event] = [
        PromptReady(4),
        *(TokenText(tokenizer.decode([i], skip_special_tokens=False), i) for i in ids),
        Finish("cancelled"),
        Usage(4, len(ids)),
    ]
    ctx = make_ctx(stop=[stop])
    stages = [
        build_thinking(ThinkingParams(), ENV),
        build_tool_calls(ToolCallsParams(format="json"), ENV),
        build_stop_sequences(StopSequencesParams(), ENV),
    ]
    stream = iter(events)
    for stage in stages:
        stage.prepare(ctx)
        stream = stage(stream, ctx)
    seen = ""
    out = []
    for event in stream:  # check what a client would have seen at every step
        out.append(event)
        if isinstance(event, ContentDelta):
            seen += event.text
            assert "END" not in seen and "_OF" not in seen, seen
    assert without_usage(summarize(out)) == [
        ("reasoning", "ok"),
        ("content", "The answer is 42."),
        ("finish", "stop", stop),
    ]
    assert ctx.cancel_reason == "stop_sequence"
