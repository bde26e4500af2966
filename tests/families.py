"""One model answer per demo family (pipelines/*.yaml), in each family's own markup: the
reasoning "Plan: call the tool.", the text "Sure." and one get_weather call with
{"city": "Paris", "days": "2"} (coerced to the tool's integer). Replayed exactly through
the family's real tokenizer by the stage tests (tests/stages/test_pipelines_e2e.py) and
by the protocol conformance suite (tests/api/test_protocol_conformance.py)."""

from __future__ import annotations

REASONING = "Plan: call the tool."
TEXT = "Sure."
CALL = ("get_weather", {"city": "Paris", "days": 2})

COMPLETIONS: dict[str, str] = {
    "qwen3": (
        "<think>\nPlan: call the tool.\n</think>\n\nSure.<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": "2"}}\n</tool_call>'
    ),
    "glm": (
        "Plan: call the tool.</think>Sure.<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"
    ),
    "kimi": (
        "<think>Plan: call the tool.</think>Sure.<|tool_calls_section_begin|><|tool_call_begin|>"
        'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris", "days": "2"}'
        "<|tool_call_end|><|tool_calls_section_end|>"
    ),
    "gpt-oss": (
        "<|channel|>analysis<|message|>Plan: call the tool.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": "2"}<|call|>'
    ),
    "chatml": (
        'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    ),
    "llama3": 'Sure.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": "2"}}',
    "mistral": (
        "[THINK]Plan: call the tool.[/THINK]Sure.[TOOL_CALLS]get_weather[ARGS]"
        '{"city": "Paris", "days": "2"}'
    ),
    "qwen3-coder": (
        "Sure.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
    ),
    "deepseek": (
        "Plan: call the tool.\n</think>\n\nSure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
        '<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris", "days": "2"}\n```<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜>"
    ),
    "phi4": (
        'Sure.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": "2"}}]'
        "<|/tool_call|>"
    ),
    "granite": (
        'Sure.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": "2"}}]'
    ),
    "gemma": 'Sure.```tool_code\nget_weather(city="Paris", days="2")\n```',
}
# What each family's answer carries besides the call (chatml has no reasoning; GPT-OSS
# calls straight from its analysis channel, without text).
HAS_REASONING = {"qwen3": True, "glm": True, "kimi": True, "gpt-oss": True, "chatml": False}
HAS_REASONING.update({"mistral": True, "deepseek": True})
HAS_REASONING.update({f: False for f in ("llama3", "qwen3-coder", "phi4", "granite", "gemma")})
HAS_TEXT = {family: family != "gpt-oss" for family in COMPLETIONS}
# Families whose chat template ends the prompt inside the think block.
OPENS_THINKING = frozenset({"glm", "deepseek"})
DEMO = {"chatml": "qwen3"}  # families without their own demo model: the one they run on
# The answer's last token that ends generation (one of the model's EOS ids), so a client
# reading the raw text (legacy Completions) does not see it.
STOPS_ON = {"gpt-oss": "<|call|>"}


# ---- the tool-call families of issue 36: one scripted answer per scenario, replayed
# through the real server (tests/server/test_family_calls_sdk.py). Tools: get_weather
# {"city": str, "days": int} and get_time {"tz": str}.
TIME_CALL = ("get_time", {"tz": "UTC"})
_B, _C, _S, _E, _BE = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
)
_DS_WEATHER = f'{_C}function{_S}get_weather\n```json\n{{"city": "Paris", "days": 2}}\n```{_E}'
_DS_TIME = f'{_C}function{_S}get_time\n```json\n{{"tz": "UTC"}}\n```{_E}'
_QC_WEATHER = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
)
_QC_TIME = (
    "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call>"
)
_ARRAY = '[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]'
_ARRAY2 = (
    '[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
    '{"name": "get_time", "arguments": {"tz": "UTC"}}]'
)
_LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'
_LLAMA_TIME = '{"name": "get_time", "parameters": {"tz": "UTC"}}'

# family -> scenario -> the model's raw answer
CALL_SCENARIOS: dict[str, dict[str, str]] = {
    "llama3": {
        "single": _LLAMA,
        "two": f"<|python_tag|>{_LLAMA}; {_LLAMA_TIME}",
        "malformed": '<|python_tag|>{"function": get_weather}',
    },
    "mistral": {
        "single": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}',
        "two": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}',
        "malformed": '[TOOL_CALLS]get weather now[ARGS]{"city": "Paris"}',
        "in_reasoning": '[THINK]I could write [TOOL_CALLS]get_time[ARGS]{"tz": "UTC"} here.[/THINK]Done.',
    },
    "qwen3-coder": {
        "single": _QC_WEATHER,
        "two": f"{_QC_WEATHER}\n{_QC_TIME}",
        "malformed": '<tool_call>\n{"name": "get_weather"}\n</tool_call>',
    },
    "deepseek": {
        "single": f"Need it.\n</think>\n\n{_B}{_DS_WEATHER}{_BE}",
        "two": f"Need both.\n</think>\n\n{_B}{_DS_WEATHER}\n{_DS_TIME}{_BE}",
        "malformed": f'</think>{_B}{_C}function{_S}get_weather {{"city": "Paris"}}{_E}{_BE}',
        "in_reasoning": f"I could write {_B}{_DS_TIME}{_BE} here.\n</think>\n\nDone.",
    },
    "phi4": {
        "single": f"<|tool_call|>{_ARRAY}<|/tool_call|>",
        "two": f"<|tool_call|>{_ARRAY2}<|/tool_call|>",
        "malformed": '<|tool_call|>get_weather(city="Paris")<|/tool_call|>',
    },
    "granite": {
        "single": f"<|tool_call|>{_ARRAY}",
        "two": f"<|tool_call|>{_ARRAY2}",
        "malformed": '<|tool_call|>get_weather(city="Paris")',
    },
    "gemma": {
        "single": '```tool_code\nget_weather(city="Paris", days=2)\n```',
        "two": '```tool_code\nget_weather(city="Paris", days=2)\nget_time(tz="UTC")\n```',
        "malformed": "```tool_code\nget_weather(Paris)\n```",
    },
}
