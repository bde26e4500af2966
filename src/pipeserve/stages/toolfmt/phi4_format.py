"""Phi-4-mini tool calls: `<|tool_call|>[{"name": "f", "arguments": {...}}, ...]<|/tool_call|>`.

The array streams element by element (toolfmt/call_array.py): a call starts as soon as
its name is read and its arguments stream as they are generated.
"""

from __future__ import annotations

import json
from typing import ClassVar, Literal

from pydantic import Field

from pipeserve.stages.toolfmt.array_parser import ArrayFormat
from pipeserve.stages.toolfmt.base import CallSink, ToolFormat
from pipeserve.stages.toolfmt.registry import (
    CallFrame,
    CallsLayout,
    ToolFormatParams,
    register_tool_format,
)

_START, _END = "<|tool_call|>", "<|/tool_call|>"


def array_frame(start: str, end: str, name: str) -> CallFrame:
    """`START[{"name": "NAME", "arguments": ` ... `}]END`: one call in the array shape."""
    return CallFrame(f'{start}[{{"name": {json.dumps(name)}, "arguments": ', f"}}]{end}")


class Phi4Params(ToolFormatParams):
    MARKER_FIELDS: ClassVar[tuple[str, ...]] = ("start", "end")

    format: Literal["phi4"]
    start: str = Field(_START, description="Opens the calls (a JSON array follows).")
    end: str = Field(_END, description="Closes the calls.")
    prefill_required: str = Field(
        _START + '[{"name": "', description="Prompt suffix forcing some call."
    )
    prefill_function: str = Field(
        _START + '[{"name": "{name}", "arguments": ',
        description="Prompt suffix forcing a call to {name}.",
    )

    def call_frame(self, name: str) -> CallFrame:
        return array_frame(self.start, self.end, name)

    def calls_layout(self) -> CallsLayout:
        return CallsLayout(self.start)


@register_tool_format("phi4", Phi4Params)
def phi4_parser(params: Phi4Params, sink: CallSink, calls_enabled: bool) -> ToolFormat:
    """Phi-4-mini: `<|tool_call|>[{"name": .., "arguments": {..}}]<|/tool_call|>`."""
    return ArrayFormat(sink, params.start, params.end)
