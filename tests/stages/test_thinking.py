"""thinking stage: (completion text, prompt opened thinking) -> summarized events, for every
tokenization that splits a marker across tokens."""

from __future__ import annotations

import pytest

from pipeserve.events import Finish, TokenText, Usage
from pipeserve.stages.thinking import ThinkingParams, build_thinking

from .helpers import ENV, make_ctx, run, splits, summarize, token_events, without_usage

MARKERS = ("<think>", "</think>")

CASES = [
    # (id, completion, opened by prompt, expected summary without usage)
    (
        "qwen3",
        "<think>\nLet me see.\n</think>\n\nHello!",
        False,
        [("reasoning", "Let me see."), ("content", "Hello!"), ("finish", "stop")],
    ),
    (
        "opened-by-prompt",
        "The user greets me.</think>Hello!",
        True,
        [("reasoning", "The user greets me."), ("content", "Hello!"), ("finish", "stop")],
    ),
    (
        "no-thinking",
        "Just an answer.\n",
        False,
        [("content", "Just an answer.\n"), ("finish", "stop")],
    ),
    (
        "content-before",
        "Hm <think>x</think> y",
        False,
        [("content", "Hm "), ("reasoning", "x"), ("content", " y"), ("finish", "stop")],
    ),
    (
        "unclosed-reasoning",
        "<think>still thinking",
        False,
        [("reasoning", "still thinking"), ("finish", "stop")],
    ),
    (
        "partial-marker-released",
        "a <thin b </thinking>",
        False,
        [("content", "a <thin b </thinking>"), ("finish", "stop")],
    ),
    (
        "partial-end-at-eos",
        "<think>abc</thi",
        False,
        [("reasoning", "abc</thi"), ("finish", "stop")],
    ),
    (
        "inner-newlines-kept",
        "<think>\n\na\n\nb\n\n</think>\n\nc\n",
        False,
        [("reasoning", "a\n\nb"), ("content", "c\n"), ("finish", "stop")],
    ),
    (
        "unicode",
        "<think>ünïcødé 思考</think>答え 🙂",
        False,
        [("reasoning", "ünïcødé 思考"), ("content", "答え 🙂"), ("finish", "stop")],
    ),
    (
        "empty-reasoning",
        "<think>\n\n</think>\n\nOK",
        False,
        [("content", "OK"), ("finish", "stop")],
    ),
]


@pytest.mark.parametrize(
    "completion,opened,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_thinking_every_split(completion: str, opened: bool, expected: list) -> None:
    stage = build_thinking(ThinkingParams(), ENV)
    for tokens in splits(completion, MARKERS):
        got = without_usage(
            summarize(run(stage, token_events(tokens), make_ctx(opened_thinking=opened)))
        )
        assert got == expected, tokens


def test_emit_tags_in_content_keeps_raw_text() -> None:
    stage = build_thinking(ThinkingParams(emit_tags_in_content=True), ENV)
    completion = "<think>\nwhy\n</think>\n\nbecause"
    for tokens in splits(completion, MARKERS):
        got = without_usage(summarize(run(stage, token_events(tokens))))
        assert got == [("content", completion), ("finish", "stop")]
    opened = run(stage, token_events(["why</think>so"]), make_ctx(opened_thinking=True))
    assert without_usage(summarize(opened)) == [
        ("content", "<think>why</think>so"),
        ("finish", "stop"),
    ]


def test_no_newline_stripping_when_disabled() -> None:
    stage = build_thinking(ThinkingParams(strip_leading_newlines=False), ENV)
    got = summarize(run(stage, token_events(["<think>\nx\n</think>\n\ny"])))
    assert without_usage(got) == [("reasoning", "\nx\n"), ("content", "\n\ny"), ("finish", "stop")]


def test_custom_markers() -> None:
    stage = build_thinking(ThinkingParams(start="◁think▷", end="◁/think▷"), ENV)
    for tokens in splits("◁think▷a◁/think▷b", ("◁think▷", "◁/think▷")):
        assert without_usage(summarize(run(stage, token_events(tokens)))) == [
            ("reasoning", "a"),
            ("content", "b"),
            ("finish", "stop"),
        ]


def test_content_keeps_token_ids_and_logprobs() -> None:
    stage = build_thinking(ThinkingParams(), ENV)
    events = [
        TokenText("<think>", 1),
        TokenText("r", 2),
        TokenText("</think>A", 3, logprob=-0.5),
        TokenText("B", 4, logprob=-0.1),
        Finish("stop"),
        Usage(1, 4),
    ]
    out = run(stage, events)
    content = [e for e in out if isinstance(e, TokenText)]
    assert content == [TokenText("A", 3, logprob=-0.5), TokenText("B", 4, logprob=-0.1)]


def test_reasoning_tokens_counted() -> None:
    stage = build_thinking(ThinkingParams(), ENV)
    out = run(stage, token_events(["<think>", "a", "b", "</think>", "c", "d"]))
    assert out[-1] == Usage(5, 6, reasoning_tokens=4)
    opened = run(stage, token_events(["a", "b", "</think>", "c"]), make_ctx(opened_thinking=True))
    assert opened[-1] == Usage(5, 4, reasoning_tokens=3)
    none = run(stage, token_events(["c", "d"]))
    assert none[-1] == Usage(5, 2, reasoning_tokens=0)


def test_truncated_flushes_held_marker_prefix_before_finish() -> None:
    stage = build_thinking(ThinkingParams(), ENV)
    out = summarize(run(stage, token_events(["answer <th"], finish="length")))
    assert out == [("content", "answer <th"), ("finish", "length"), ("usage", 1, 0)]


def test_prompt_opened_thinking_is_read_lazily() -> None:
    stage = build_thinking(ThinkingParams(), ENV)
    ctx = make_ctx(opened_thinking=True)
    stage.prepare(ctx)
    assert ctx.think_close == "</think>\n\n"
    ctx.prompt_opened_thinking = False  # e.g. a forced tool call closed the block in the prefill
    out = summarize(stage(iter(token_events(["plain"])), ctx))
    assert without_usage(out) == [("content", "plain"), ("finish", "stop")]
