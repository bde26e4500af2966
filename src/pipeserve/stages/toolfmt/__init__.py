"""Tool-call output formats (json, glm, kimi, harmony) and their shared helpers."""

from __future__ import annotations

from dataclasses import dataclass

FORMATS: tuple[str, ...] = ("json", "glm", "kimi", "harmony")


@dataclass(frozen=True)
class FormatDefaults:
    start: str = ""
    end: str = ""
    section_start: str = ""
    section_end: str = ""
    args_marker: str = ""
    prefill_required: str = ""
    prefill_function: str = ""  # "{name}" is replaced by the function's name


_KIMI_SECTION = "<|tool_calls_section_begin|>"
_KIMI_CALL = "<|tool_call_begin|>"

DEFAULTS: dict[str, FormatDefaults] = {
    "json": FormatDefaults(
        start="<tool_call>",
        end="</tool_call>",
        prefill_required="<tool_call>\n",
        prefill_function='<tool_call>\n{"name": "{name}", "arguments": ',
    ),
    "glm": FormatDefaults(
        start="<tool_call>",
        end="</tool_call>",
        prefill_required="<tool_call>",
        prefill_function="<tool_call>{name}\n",
    ),
    "kimi": FormatDefaults(
        start=_KIMI_CALL,
        end="<|tool_call_end|>",
        section_start=_KIMI_SECTION,
        section_end="<|tool_calls_section_end|>",
        args_marker="<|tool_call_argument_begin|>",
        prefill_required=_KIMI_SECTION + _KIMI_CALL,
        prefill_function=_KIMI_SECTION
        + _KIMI_CALL
        + "functions.{name}:0<|tool_call_argument_begin|>",
    ),
    "harmony": FormatDefaults(
        prefill_required="<|channel|>commentary to=functions.",
        prefill_function="<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>",
    ),
}
