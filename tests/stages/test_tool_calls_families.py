"""The tool-call formats of issue 36 (llama3, mistral, qwen3_coder, deepseek, phi4,
granite, gemma), each on its own text at every token split: calls come out whole and
coerced, several per turn, after text; what is not a call is the text it was, never
lost; a call cut by max_tokens keeps "length"; the forced prefill parses as written."""

from __future__ import annotations

import pytest

from pipeserve.events import ToolCallArgsDelta, ToolCallStart
from pipeserve.request import ToolChoice
from pipeserve.stages.tool_calls import ToolCallsParams, build_tool_calls

from .helpers import ENV, make_ctx, run, splits, summarize, token_events, without_usage

B, C, S, E, BE = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
)
MARKERS = {
    "llama3": ("<|python_tag|>", '"parameters": ', ";"),
    "mistral": ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", '"arguments": '),
    "qwen3_coder": ("<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=",
                    "</parameter>"),
    "deepseek": (B, C, S, E, BE, "```"),
    "phi4": ("<|tool_call|>", "<|/tool_call|>", '"arguments": '),
    "granite": ("<|tool_call|>", '"arguments": '),
    "gemma": ("```json", "```tool_code", "```"),
}  # fmt: skip
WEATHER = ("call", "get_weather", '{"city": "Paris", "days": 2}')
TIME = ("call", "get_time", '{"tz": "UTC"}')
DONE = ("finish", "tool_calls")

CASES = [
    # -- llama3: whole message, after the tag, several with `;`, built-ins
    ("llama3", "whole-message", '{"name": "get_weather", "parameters": {"city": "Paris", "days": "2"}}',
     [WEATHER, DONE]),
    ("llama3", "two-calls", ' {"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
     '{"name": "get_time", "parameters": {"tz": "UTC"}}', [WEATHER, TIME, DONE]),
    ("llama3", "after-text-tagged", 'Let me check.<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}',
     [("content", "Let me check."), TIME, DONE]),
    ("llama3", "arguments-key", '<|python_tag|>{"name": "get_time", "arguments": {"tz": "UTC"}}', [TIME, DONE]),
    ("llama3", "builtin", '<|python_tag|>brave_search.call(query="weather paris")',
     [("call", "brave_search", '{"query": "weather paris"}'), DONE]),
    ("llama3", "json-answer-is-text", '{"name": "Bob", "parameters": {"age": 3}}',
     [("content", '{"name": "Bob", "parameters": {"age": 3}}'), ("finish", "stop")]),
    ("llama3", "braces-are-text", "{not json} text", [("content", "{not json} text"), ("finish", "stop")]),
    ("llama3", "code-is-text", "<|python_tag|>print(1+1)",
     [("content", "<|python_tag|>print(1+1)"), ("finish", "stop")]),
    ("llama3", "json-later-is-text", 'Hello {"name": "get_time", "parameters": {}}',
     [("content", 'Hello {"name": "get_time", "parameters": {}}'), ("finish", "stop")]),
    ("llama3", "pythonic-list", ' [get_weather(city="Paris", days=2), get_time(tz="UTC")]',
     [WEATHER, TIME, DONE]),
    ("llama3", "pythonic-unknown-is-text", "[print(1)]", [("content", "[print(1)]"), ("finish", "stop")]),
    ("llama3", "bracket-text", "[1] is a footnote", [("content", "[1] is a footnote"), ("finish", "stop")]),
    ("llama3", "text-after-tagged-call", '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}} ok',
     [TIME, ("content", " ok"), DONE]),
    ("llama3", "json-array", '[{"name": "get_time", "parameters": {"tz": "UTC"}}]', [TIME, DONE]),
    # -- mistral: v11+ NAME[ARGS], [CALL_ID], the older array
    ("mistral", "v11", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": "2"}',
     [("content", "Sure."), WEATHER, DONE]),
    ("mistral", "v11-two", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}'
     '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}', [WEATHER, TIME, DONE]),
    ("mistral", "call-id", '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"tz": "UTC"}', [TIME, DONE]),
    ("mistral", "array", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
     '{"name": "get_time", "arguments": {"tz": "UTC"}, "id": "abc123def"}]', [WEATHER, TIME, DONE]),
    ("mistral", "array-keys-reordered", '[TOOL_CALLS][{"arguments": {"tz": "UTC"}, "name": "get_time"}]',
     [TIME, DONE]),
    ("mistral", "bad-name-is-text", 'Hi [TOOL_CALLS]not a name[ARGS]{"x": 1}',
     [("content", 'Hi [TOOL_CALLS]not a name[ARGS]{"x": 1}'), ("finish", "stop")]),
    ("mistral", "prose-after-marker-is-text", "[TOOL_CALLS] is how I call tools, see [ARGS]",
     [("content", "[TOOL_CALLS] is how I call tools, see [ARGS]"), ("finish", "stop")]),
    ("mistral", "bare-marker-is-text", "Hi [TOOL_CALLS]get_time",
     [("content", "Hi [TOOL_CALLS]get_time"), ("finish", "stop")]),
    # -- qwen3_coder: raw-text values typed by the schema
    ("qwen3_coder", "single", "Sure.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
     "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
     [("content", "Sure."), WEATHER, DONE]),
    ("qwen3_coder", "typed-and-two", "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew\nYork "
     '"x" \\ \n</parameter>\n<parameter=options>\n{"hourly": "true"}\n</parameter>\n<parameter=hours>\n'
     "[1, 2]\n</parameter>\n<parameter=metric>\nfalse\n</parameter>\n<parameter=ratio>\n1.5\n</parameter>\n"
     "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
     [("call", "get_weather", '{"city": "New\\nYork \\"x\\" \\\\ ", "options": {"hourly": true}, '
       '"hours": [1, 2], "metric": false, "ratio": 1.5}'), ("call", "get_time", "{}"), DONE]),
    ("qwen3_coder", "missing-parameter-end", "<tool_call>\n<function=get_weather>\n<parameter=days>\nabc\n"
     "<parameter=city>Rome</function></tool_call>",
     [("call", "get_weather", '{"days": "abc", "city": "Rome"}'), DONE]),  # abc: passed as written
    ("qwen3_coder", "prose-function-is-text", "<tool_call><function=a long name> x</tool_call>",
     [("content", "<tool_call><function=a long name> x</tool_call>"), ("finish", "stop")]),
    ("qwen3_coder", "json-inside-is-text", 'x<tool_call>{"name": "get_time"}</tool_call>y',
     [("content", 'x<tool_call>{"name": "get_time"}</tool_call>y'), ("finish", "stop")]),
    ("qwen3_coder", "unicode", "天気<tool_call><function=get_weather><parameter=city>東京 🙂</parameter>"
     "</function></tool_call>", [("content", "天気"), ("call", "get_weather", '{"city": "東京 🙂"}'), DONE]),
    # -- deepseek: V3 fenced JSON, V3.1 plain, several calls in one section
    ("deepseek", "v3", f'Sure.{B}{C}function{S}get_weather\n```json\n{{"city": "Paris", "days": "2"}}\n```{E}{BE}',
     [("content", "Sure."), WEATHER, DONE]),
    ("deepseek", "v3-two", f'{B}{C}function{S}get_weather\n```json\n{{"city": "Paris", "days": 2}}\n```{E}\n'
     f'{C}function{S}get_time\n```json\n{{"tz": "UTC"}}\n```{E}{BE}', [WEATHER, TIME, DONE]),
    ("deepseek", "v31", f'{B}{C}get_time{S}{{"tz": "UTC"}}{E}{BE}', [TIME, DONE]),
    ("deepseek", "malformed-is-text", f"x{B}{C}function{S}bad name no fence{E}{BE}y",
     [("content", f"x{B}{C}function{S}bad name no fence{E}{BE}y"), ("finish", "stop")]),
    # -- phi4 / granite: a JSON array after the marker
    ("phi4", "two", 'Sure.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": "2"}}, '
     '{"name": "get_time", "arguments": {"tz": "UTC"}}]<|/tool_call|>', [("content", "Sure."), WEATHER, TIME, DONE]),
    ("phi4", "function-wrapper", '<|tool_call|>[{"type": "function", "function": {"name": "get_time", '
     '"arguments": "{\\"tz\\": \\"UTC\\"}"}}]<|/tool_call|>', [TIME, DONE]),
    ("phi4", "malformed-is-text", "Sure.<|tool_call|>[{\"name\": get}]<|/tool_call|> ok",
     [("content", 'Sure.<|tool_call|>[{"name": get}]<|/tool_call|> ok'), ("finish", "stop")]),
    ("granite", "single", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]',
     [WEATHER, DONE]),
    ("granite", "text-after", '<|tool_call|>[{"name": "get_time", "arguments": {"tz": "UTC"}}]\nDone.',
     [TIME, ("content", "\nDone."), DONE]),
    ("granite", "prose-is-text", "<|tool_call|>nope", [("content", "<|tool_call|>nope"), ("finish", "stop")]),
    # -- gemma: fenced tool_code / json blocks naming the request's tools
    ("gemma", "tool-code", 'Sure.```tool_code\nget_weather(city="Paris", days=2)\n```',
     [("content", "Sure."), WEATHER, DONE]),
    ("gemma", "tool-code-lines", '```tool_code\nget_weather(city="Paris", days=2)\nget_time(tz="UTC")\n```',
     [WEATHER, TIME, DONE]),
    ("gemma", "json-two-blocks", '```json\n{"name": "get_weather", "parameters": {"city": "Paris", "days": "2"}}\n```\n'
     '```json\n{"name": "get_time", "parameters": {"tz": "UTC"}}\n```', [WEATHER, TIME, DONE]),
    ("gemma", "python-list", '[get_weather(city="Paris", days=2), get_time(tz="UTC")]', [WEATHER, TIME, DONE]),
    ("gemma", "python-list-unknown-is-text", "[print(1)] and more",
     [("content", "[print(1)] and more"), ("finish", "stop")]),
    ("gemma", "bracket-text", "[1] A footnote.", [("content", "[1] A footnote."), ("finish", "stop")]),
    ("gemma", "json-sample-is-text", 'Example:\n```json\n{"a": 1}\n```\nbye',
     [("content", 'Example:\n```json\n{"a": 1}\n```\nbye'), ("finish", "stop")]),
    ("gemma", "code-is-text", '```tool_code\nprint("hi")\n```',
     [("content", '```tool_code\nprint("hi")\n```'), ("finish", "stop")]),
    ("gemma", "other-fence-is-text", "```python\nx = 1\n```",
     [("content", "```python\nx = 1\n```"), ("finish", "stop")]),
]  # fmt: skip


def stage(fmt: str):
    return build_tool_calls(ToolCallsParams(format=fmt), ENV)


@pytest.mark.parametrize(
    "fmt,completion,expected",
    [(c[0], c[2], c[3]) for c in CASES],
    ids=[f"{c[0]}-{c[1]}" for c in CASES],
)
def test_every_split(fmt: str, completion: str, expected: list) -> None:
    built = stage(fmt)
    for tokens in splits(completion, MARKERS[fmt]):
        assert without_usage(summarize(run(built, token_events(tokens)))) == expected, tokens


CUT = {
    "llama3": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Pa',
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nPa",
    "deepseek": f'{B}{C}function{S}get_weather\n```json\n{{"city": "Pa',
    "phi4": '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Pa',
    "granite": '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Pa',
    "gemma": '```json\n{"name": "get_weather", "parameters": {"city": "Pa',
}


@pytest.mark.parametrize("fmt", sorted(CUT))
def test_a_call_cut_by_max_tokens_keeps_length(fmt: str) -> None:
    for tokens in splits(CUT[fmt], MARKERS[fmt]):
        got = without_usage(summarize(run(stage(fmt), token_events(tokens, finish="length"))))
        assert got[-1] == ("finish", "length"), tokens
        calls = [item for item in got if item[0] == "call"]
        assert calls == [("call", "get_weather", '{"city": "Pa')], got


@pytest.mark.parametrize("fmt", sorted(CUT))
def test_arguments_stream_before_the_call_ends(fmt: str) -> None:
    """The call starts, and its arguments flow, while the model is still writing them."""
    events = run(stage(fmt), token_events(list(CUT[fmt]), finish="length"))
    kinds = [type(e) for e in events]
    start = kinds.index(ToolCallStart)
    deltas = [e.fragment for e in events if isinstance(e, ToolCallArgsDelta)]
    assert start < kinds.index(ToolCallArgsDelta)
    # every format but Gemma's tool_code streams the string value character by character
    assert len(deltas) >= 3, deltas


FORCED = {
    "llama3": ('{"city": "Paris", "days": 2}}', "<|python_tag|>"),
    "mistral": ('{"city": "Paris", "days": 2}', "[TOOL_CALLS]get_weather[ARGS]"),
    "qwen3_coder": ("<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
                    "</function>\n</tool_call>", "<tool_call>\n<function=get_weather>\n"),
    "deepseek": ('{"city": "Paris", "days": 2}\n```' + E + BE, B + C + "function" + S),
    "phi4": ('{"city": "Paris", "days": 2}}]<|/tool_call|>', "<|tool_call|>["),
    "granite": ('{"city": "Paris", "days": 2}}]', "<|tool_call|>["),
    "gemma": ('{"city": "Paris", "days": 2}}\n```', "```json\n"),
}  # fmt: skip


@pytest.mark.parametrize("fmt", sorted(FORCED))
def test_named_forced_prefill_parses_as_the_call(fmt: str) -> None:
    body, opening = FORCED[fmt]
    ctx = make_ctx(tool_choice=ToolChoice("function", "get_weather"))
    built = stage(fmt)
    built.prepare(ctx)
    assert ctx.assistant_prefill.startswith(opening) and ctx.grammar_plan is not None
    got = without_usage(summarize(built(iter(token_events([body])), ctx)))
    assert got == [WEATHER, DONE]


def test_every_new_format_forces_required_calls_with_a_frame() -> None:
    """tool_choice required: a prefill every tool's call frame starts with."""
    from pipeserve.stages.toolfmt.registry import TOOL_FORMATS

    for fmt in FORCED:
        params = TOOL_FORMATS[fmt].params_model(format=fmt)
        prefill = params.forced_prefill(None)
        frame = params.call_frame("get_weather") or params.pair_frame("get_weather")
        assert frame is not None and frame.prefix.startswith(prefill), fmt


def test_a_qwen3_coder_value_that_does_not_fit_is_kept_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\ntwo\n</parameter>\n</function>\n</tool_call>"
    )
    with caplog.at_level("INFO", logger="pipeserve.toolfmt"):
        got = without_usage(summarize(run(stage("qwen3_coder"), token_events([text]))))
    assert got == [("call", "get_weather", '{"city": "Paris", "days": "two"}'), DONE]
    assert any("'days' does not fit its schema" in r.getMessage() for r in caplog.records)
