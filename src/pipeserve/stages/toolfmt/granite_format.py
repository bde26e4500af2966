"""IBM Granite 3.x / 4 tool calls: `<|tool_call|>[{"name": "f", "arguments": {...}}, ...]`.

No end marker: the array's closing bracket ends the calls (the turn usually ends there).
Elements stream as in Phi-4-mini's format (toolfmt/call_array.py).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from pipeserve.stages.toolfmt.array_parser import ArrayFormat
from pipeserve.stages.toolfmt.base import CallSink, ToolFormat
from pipeserve.stages.toolfmt.phi4_format import array_frame
from pipeserve.stages.toolfmt.registry import (
    CallFrame,
    CallsLayout,
    ToolFormatParams,
    register_tool_format,
)

_START = "<|tool_call|>"


class GraniteParams(ToolFormatParams):
    MARKER_FIELDS: ClassVar[tuple[str, ...]] = ("start",)

    format: Literal["granite"]
    start: str = Field(_START, description="Opens the calls (a JSON array follows).")
    prefill_required: str = Field(
        _START + '[{"name": "', description="Prompt suffix forcing some call."
    )
    prefill_function: str = Field(
        _START + '[{"name": "{name}", "arguments": ',
        description="Prompt suffix forcing a call to {name}.",
    )

    def call_frame(self, name: str) -> CallFrame:
        return array_frame(self.start, "", name)

    def calls_layout(self) -> CallsLayout:
        return CallsLayout(self.start)


@register_tool_format("granite", GraniteParams)
def granite_parser(params: GraniteParams, sink: CallSink, calls_enabled: bool) -> ToolFormat:
    """Granite: `<|tool_call|>[{"name": .., "arguments": {..}}]`, no end marker."""
    return ArrayFormat(sink, params.start)
