"""Fuzz: arbitrary mixes of markers, JSON pieces and text never raise, keep the tool-call
invariants (checked by summarize) and give the same result for any tokenization."""

from __future__ import annotations

import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeserve.events import Finish, PromptReady, TokenText, Usage
from pipeserve.stages.tool_calls import ToolCallsParams, build_tool_calls

from .helpers import ENV, run, summarize, token_events, without_usage

PIECES = {
    "json": [
        "<tool_call>",
        "</tool_call>",
        '{"name": "get_weather", "arguments": ',
        '{"city": "Paris"',
        '"days": "3"',
        ", ",
        "}",
        "{",
        "[",
        "]",
        '"',
        "\\",
        "\n",
        "text ",
        "<tool",
        "_call>",
        "ü🙂",
    ],
    "glm": [
        "<tool_call>",
        "</tool_call>",
        "get_weather",
        "<arg_key>",
        "</arg_key>",
        "<arg_value>",
        "</arg_value>",
        "city",
        "days",
        "3",
        "Paris",
        "\n",
        " ",
        "text",
        "<",
        '{"a": 1}',
    ],
    "kimi": [
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        "functions.get_weather:0",
        '{"city": ',
        '"Paris"',
        '"3"',
        "}",
        ", ",
        "text",
        "<|tool",
        "\n",
    ],
}
_OBJECT = ['{"name": "get_weather", "arguments": ', '{"name": "get_time", "parameters": ',
           '{"city": "Paris"', '"days": "3"', ", ", "}", "{", "[", "]", '"', "\\", "\n", "text "]  # fmt: skip
PIECES.update(
    {
        "llama3": ["<|python_tag|>", ";", " ", *_OBJECT, "brave_search.call(query='x')", "get_time(tz='UTC')"],
        "mistral": ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "get_weather", "abc12", *_OBJECT],
        "phi4": ["<|tool_call|>", "<|/tool_call|>", "<|tool", *_OBJECT],
        "granite": ["<|tool_call|>", *_OBJECT],
        "gemma": ["```json", "```tool_code", "```", "get_time(tz='UTC')", "print(1)", *_OBJECT],
        "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=", "</function>", "get_weather",
                        ">", "<parameter=", "</parameter>", "city", "days", "3", "Paris", "\n",
                        '{"a": 1}', "<", "text"],
        "deepseek": ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                     "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "function", "get_weather", "\n```json\n",
                     "\n```", '{"city": ', '"Paris"', "}", "text", "\n"],
    }
)  # fmt: skip


def tokenize(text: str, rng: random.Random) -> list[str]:
    cuts = (
        sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
        if len(text) > 1
        else []
    )
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(sorted(PIECES)), st.data(), st.sampled_from(["stop", "length"]), st.randoms()
)
def test_fuzz_text_formats(fmt: str, data: st.DataObject, finish: str, rng: Any) -> None:
    text = "".join(data.draw(st.lists(st.sampled_from(PIECES[fmt]), max_size=25)))
    stage = build_tool_calls(ToolCallsParams(format=fmt), ENV)
    whole = without_usage(summarize(run(stage, token_events([text], finish))))
    assert without_usage(summarize(run(stage, token_events(tokenize(text, rng), finish)))) == whole
    assert without_usage(summarize(run(stage, token_events(list(text), finish)))) == whole


def test_fuzz_harmony_random_tokens(harmony_encoding: Any) -> None:
    """A model that does not speak Harmony (random ids, specials included) never breaks the stage."""
    rng = random.Random(7)
    specials = harmony_encoding.encode(
        "<|start|><|channel|><|message|><|end|><|call|><|constrain|>", allowed_special="all"
    )
    stage = build_tool_calls(ToolCallsParams(format="harmony"), ENV)
    for _ in range(30):
        ids = [
            rng.choice(specials) if rng.random() < 0.15 else rng.randrange(0, 199_000)
            for _ in range(60)
        ]
        tokens = [TokenText(harmony_encoding.decode([i]), i) for i in ids]
        events = [
            PromptReady(1),
            *tokens,
            Finish(rng.choice(["stop", "length"])),
            Usage(1, len(ids)),
        ]
        summary = summarize(run(stage, events))  # type: ignore[arg-type]
        assert summary[-2][0] == "finish" and summary[-1][0] == "usage"
    plain = [
        TokenText(harmony_encoding.decode([i]), i)
        for i in harmony_encoding.encode("just some plain words " * 30)
    ]
    out = summarize(run(stage, [PromptReady(1), *plain, Finish("length"), Usage(1, len(plain))]))  # type: ignore[list-item]
    assert out[0] == ("content", "just some plain words " * 30)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from(["<think>", "</think>", "\n", "\n\n", "ab", "<th", "ink>", "</", "é"]),
        max_size=20,
    ),
    st.booleans(),
    st.booleans(),
    st.randoms(),
)
def test_fuzz_thinking_tokenization_invariant(
    pieces: list[str], opened: bool, strip: bool, rng: Any
) -> None:
    from pipeserve.stages.thinking import ThinkingParams, build_thinking

    from .helpers import make_ctx

    text = "".join(pieces)
    stage = build_thinking(ThinkingParams(strip_leading_newlines=strip), ENV)
    whole = summarize(run(stage, token_events([text]), make_ctx(opened_thinking=opened)))[:-1]
    split = summarize(
        run(stage, token_events(tokenize(text, rng)), make_ctx(opened_thinking=opened))
    )[:-1]
    assert split == whole


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(["ST", "OP", "S", "TOP", "x", "STOP", "\n"]), max_size=20),
    st.randoms(),
)
def test_fuzz_stop_sequences_never_leak(pieces: list[str], rng: Any) -> None:
    from pipeserve.events import ContentDelta
    from pipeserve.stages.stop_sequences import StopSequencesParams, build_stop_sequences

    from .helpers import make_ctx

    text = "".join(pieces)
    stage = build_stop_sequences(StopSequencesParams(), ENV)
    tokens = tokenize(text, rng) if text else []
    events = [PromptReady(1), *(ContentDelta(t) for t in tokens), Finish("stop"), Usage(1, 1)]
    out = summarize(run(stage, events, make_ctx(stop=["STOP", "\nx"])))  # type: ignore[arg-type]
    cut = min((i for i in (text.find("STOP"), text.find("\nx")) if i != -1), default=-1)
    expected_text = text if cut == -1 else text[:cut]
    assert (out[0][1] if out[0][0] == "content" else "") == expected_text
    assert out[-2][0] == "finish" and (len(out[-2]) == 3) == (cut != -1)
