"""GLM-4.5/4.6/4.7 tool calls:
`<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`.

Values are plain text (read as JSON when the parameter's schema is not a string);
`</arg_value>` may be missing and whitespace may sit between the parts. The format has
no JSON to stream, so a call is parsed once its end marker arrives; an unclosed or
malformed call is delivered as the raw text it was.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import Field

from pipeserve.events import Event
from pipeserve.stages.toolfmt.base import CallSink, MarkerParser, ToolFormat, content
from pipeserve.stages.toolfmt.coerce import coerce_text_value, property_schema
from pipeserve.stages.toolfmt.markers import MarkerSet
from pipeserve.stages.toolfmt.registry import (
    CallsLayout,
    PairFrame,
    ToolFormatParams,
    register_tool_format,
)

_KEY, _KEY_END, _VALUE, _VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
_ARG = re.compile(
    r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|(?=<arg_key>)|\Z)\s*",
    re.DOTALL,
)


def parse_glm_body(body: str, sink: CallSink) -> tuple[str, dict[str, Any]] | None:
    """(name, coerced arguments) of one call body, None when it is not a GLM call."""
    cut = body.find(_KEY)
    name = (body if cut == -1 else body[:cut]).strip()
    if not name or any(c in name for c in "<>{}\n"):
        return None
    schema = sink.schema(name)
    arguments: dict[str, Any] = {}
    pos = len(body) if cut == -1 else cut
    while pos < len(body):
        match = _ARG.match(body, pos)
        if match is None:
            return None
        key = match.group(1).strip()
        value = match.group(2)
        value = value.removeprefix("\n")
        value = value.removesuffix("\n")
        arguments[key] = coerce_text_value(value, property_schema(schema, key))
        pos = match.end()
    return name, arguments


class GlmFormat(MarkerParser):
    def __init__(self, sink: CallSink, start: str, end: str) -> None:
        super().__init__()
        self.sink = sink
        self._start_set, self._end_set = MarkerSet([start]), MarkerSet([end])
        self.raw: list[str] | None = None

    def _markers(self) -> MarkerSet:
        return self._end_set if self.raw is not None else self._start_set

    def _text(self, text: str, out: list[Event]) -> None:
        if self.raw is None:
            content(text, out)
        else:
            self.raw.append(text)

    def _marker(self, marker: str, out: list[Event]) -> None:
        if self.raw is None:
            self.raw = [marker]
            return
        parsed = parse_glm_body("".join(self.raw[1:]), self.sink)
        if parsed is None:
            content("".join(self.raw) + marker, out)
        else:
            self.sink.whole(parsed[0], parsed[1], out)
        self.raw = None

    def finish(self, reason: str, out: list[Event]) -> None:
        self.flush(out)
        if self.raw is not None:
            content("".join(self.raw), out)
            self.raw = None


class GlmParams(ToolFormatParams):
    MARKER_FIELDS: ClassVar[tuple[str, ...]] = ("start", "end")

    format: Literal["glm"]
    start: str = Field("<tool_call>", description="Opens a call.")
    end: str = Field("</tool_call>", description="Closes a call.")
    prefill_required: str = Field("<tool_call>", description="Prompt suffix forcing some call.")
    prefill_function: str = Field(
        "<tool_call>{name}\n", description="Prompt suffix forcing a call to {name}."
    )

    def pair_frame(self, name: str) -> PairFrame:
        return PairFrame(f"{self.start}{name}\n", self.end, _KEY, _KEY_END, _VALUE, _VALUE_END)

    def calls_layout(self) -> CallsLayout:
        return CallsLayout(self.start, separator="\n")


@register_tool_format("glm", GlmParams)
def glm_parser(params: GlmParams, sink: CallSink, calls_enabled: bool) -> ToolFormat:
    """GLM-4.5+: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>`."""
    return GlmFormat(sink, params.start, params.end)
