"""Scripted raw completions per family: what a model of that family would emit."""

from __future__ import annotations

from dataclasses import dataclass

WEATHER_TOOL_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}


@dataclass(frozen=True)
class Family:
    model: str
    text: str  # plain answer "Hello there!"
    reasoning: str  # reasoning "Let me think." then answer "Hello there!"
    tool_call: str  # reasoning then get_weather(city=Paris, days=3)
    after_tool: str  # answer using the tool result


QWEN3 = Family(
    model="replay-qwen3",
    text="<think>\n\n</think>\n\nHello there!",
    reasoning="<think>\nLet me think.\n</think>\n\nHello there!",
    tool_call='<think>\nI need the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": "3"}}\n</tool_call>',
    after_tool="<think>\n\n</think>\n\nIt is sunny in Paris.",
)

GPT_OSS = Family(
    model="replay-gpt-oss",
    text="<|channel|>final<|message|>Hello there!<|return|>",
    reasoning="<|channel|>analysis<|message|>Let me think.<|end|><|start|>assistant<|channel|>final<|message|>Hello there!<|return|>",
    tool_call=(
        "<|channel|>analysis<|message|>I need the weather.<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}<|call|>'
    ),
    after_tool="<|channel|>final<|message|>It is sunny in Paris.<|return|>",
)

FAMILIES = [QWEN3, GPT_OSS]
