"""The grammar for strict tools under tool_choice auto, checked token by token with
llguidance's matcher on a real demo tokenizer (no model run): free text, then calls in
the format's layout, strict arguments valid against their schema, other arguments any
JSON object; a plain-text call trigger (declared in YAML) can never hide in free text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pipeserve.constraint import Envelope
from pipeserve.engine.sampling.grammar import GrammarCompiler, GrammarError
from pipeserve.request import OutputFormat, ToolSpec
from pipeserve.stages.toolfmt.call_grammar import auto_call_plan
from pipeserve.stages.toolfmt.json_format import JsonParams

ARGS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [ToolSpec("weather", "", ARGS, strict=True), ToolSpec("clock", "", {"type": "object"})]
TEXT_TRIGGER = JsonParams(format="json", start="[CALL]", end="[/CALL]")  # plain-text markers
SPECIAL_TRIGGER = JsonParams(format="json")  # <tool_call>: a special token in qwen3's vocabulary


def call(name: str, arguments: str, start: str = "[CALL]", end: str = "[/CALL]") -> str:
    return f'{start}\n{{"name": "{name}", "arguments": {arguments}}}\n{end}'


GOOD = call("weather", '{"city": "Rome", "days": 3}')
ANY = call("clock", '{"any": [1, {"x": null}]}')


@pytest.fixture(scope="module")
def compiler(demo_tokenizer: Callable[[str], Any]) -> GrammarCompiler:
    tokenizer = demo_tokenizer("qwen3")
    return GrammarCompiler(tokenizer, None, tokenizer.eos_token_ids)


def accepted(compiler: GrammarCompiler, grammar: str, text: str) -> tuple[bool, bool]:
    """(every token of text fits the grammar, the grammar may end there)."""
    matcher = compiler.compile(grammar)
    tokens = compiler.encode(text)
    fits = matcher.validate_tokens(tokens) == len(tokens)
    return fits, fits and matcher.consume_tokens(tokens) and matcher.is_accepting()


def grammar(compiler: GrammarCompiler, params: JsonParams = TEXT_TRIGGER, **kw: Any) -> str:
    plan = auto_call_plan(params, kw.pop("tools", TOOLS), kw.pop("envelope", None), False, **kw)
    assert plan is not None
    return plan.build(compiler)


@pytest.mark.parametrize(
    ("text", "fits", "complete"),
    [
        ("Just text, [CALL without the bracket is fine", True, True),
        (f"Let me check. {GOOD}", True, True),
        (f"{GOOD}\n{ANY}", True, True),  # a non-strict tool: any object
        ("Some text [CALL]garbage", False, False),  # the trigger commits to a call
        (call("weather", '{"city": "Oslo", "days": 3}'), False, False),  # not in the enum
        (call("weather", '{"city": "Rome"}'), False, False),  # a required key missing
        (call("weather", '{"city": "Rome", "days": 3, "x": 1}'), False, False),  # no extras
        (call("nowhere", "{}"), False, False),  # only declared tools
        (call("clock", "[1]"), False, False),  # a non-strict tool's arguments: an object
        (f"{GOOD} and text after", False, False),  # nothing but calls after a call
        (GOOD[:-3], True, False),  # an unfinished call cannot end the answer
    ],
)
def test_text_and_calls(compiler: GrammarCompiler, text: str, fits: bool, complete: bool) -> None:
    assert accepted(compiler, grammar(compiler, single=False), text) == (fits, complete)


def test_special_token_trigger(compiler: GrammarCompiler) -> None:
    rules = grammar(compiler, SPECIAL_TRIGGER, single=False)
    good = call("weather", '{"city": "Paris", "days": 1}', "<tool_call>", "</tool_call>")
    assert accepted(compiler, rules, f"Hello {good}") == (True, True)
    assert accepted(compiler, rules, "Hello <tool_call>garbage") == (False, False)
    assert accepted(compiler, rules, "Hello <tool_call") == (True, True)  # plain text


def test_one_call_when_calls_are_not_parallel(compiler: GrammarCompiler) -> None:
    rules = grammar(compiler, single=True)
    assert accepted(compiler, rules, GOOD) == (True, True)
    assert accepted(compiler, rules, f"{GOOD}\n[CALL]") == (False, False)


def test_reasoning_comes_first_and_is_free(compiler: GrammarCompiler) -> None:
    rules = grammar(
        compiler, SPECIAL_TRIGGER, envelope=Envelope("<think>", "</think>"), single=True
    )
    good = call("weather", '{"city": "Paris", "days": 1}', "<tool_call>", "</tool_call>")
    thought = "<think>maybe {bad json} [CALL]</think>"
    assert accepted(compiler, rules, f"{thought}\n\n{good}") == (True, True)


def test_a_strict_schema_that_cannot_compile_names_the_tool(compiler: GrammarCompiler) -> None:
    bad = ToolSpec("broken", "", {"type": "object", "properties": {"a": {"type": "strin"}}}, True)
    with pytest.raises(GrammarError, match="strict tool 'broken'.*strin"):
        grammar(compiler, tools=[*TOOLS, bad], single=False)
    loose = ToolSpec("loose", "", bad.parameters)  # not strict: its schema is not used
    assert accepted(compiler, grammar(compiler, tools=[loose], single=False), "hi") == (True, True)


def test_a_client_output_format_or_calls(compiler: GrammarCompiler) -> None:
    """With response_format too, the answer follows the format or the model calls."""
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = OutputFormat("json_schema", answer)
    for params, start, end in ((TEXT_TRIGGER, "[CALL]", "[/CALL]"),
                               (SPECIAL_TRIGGER, "<tool_call>", "</tool_call>")):  # fmt: skip
        rules = grammar(compiler, params, single=False, fmt=fmt)
        good = call("weather", '{"city": "Paris", "days": 1}', start, end)
        assert accepted(compiler, rules, '{"ok": true}') == (True, True)
        assert accepted(compiler, rules, good) == (True, True)
        assert accepted(compiler, rules, "free text") == (False, False)
        assert accepted(compiler, rules, '{"ok": 1}') == (False, False)
        assert accepted(compiler, rules, call("weather", '{"city": "Nice"}', start, end)) == (
            False,
            False,
        )
