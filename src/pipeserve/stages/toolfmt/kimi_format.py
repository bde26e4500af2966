"""Kimi K2 tool calls:
`<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
<|tool_call_argument_begin|>{json}<|tool_call_end|>...<|tool_calls_section_end|>`.

The call starts when its id is complete; the JSON arguments stream through the coercing
streamer. A call whose id does not name a function is delivered as its raw text.
"""

from __future__ import annotations

import re
from typing import ClassVar, Literal

from pydantic import Field

from pipeserve.events import Event
from pipeserve.stages.toolfmt.base import (
    CallSink,
    MarkerParser,
    StreamedArgs,
    ToolFormat,
    content,
)
from pipeserve.stages.toolfmt.markers import MarkerSet
from pipeserve.stages.toolfmt.registry import (
    CallFrame,
    CallsLayout,
    ToolFormatParams,
    register_tool_format,
)

_CALL_ID = re.compile(r"\s*(?:functions\.)?([^\s:<>]+(?::[^\s:<>\d][^\s:<>]*)*)(?::\d+)?\s*")
CONTENT, SECTION, CALL_ID, ARGS = range(4)


def call_name(call_id: str) -> str | None:
    match = _CALL_ID.fullmatch(call_id)
    return match.group(1) if match else None


class KimiFormat(MarkerParser):
    def __init__(
        self,
        sink: CallSink,
        start: str,
        end: str,
        section_start: str,
        section_end: str,
        args_marker: str,
    ) -> None:
        super().__init__()
        self.sink = sink
        self.start, self.end = start, end
        self.section_start, self.section_end, self.args_marker = (
            section_start,
            section_end,
            args_marker,
        )
        self._sets = {
            CONTENT: MarkerSet([section_start, start]),
            SECTION: MarkerSet([start, section_end]),
            CALL_ID: MarkerSet([args_marker, end, section_end]),
            ARGS: MarkerSet([end, section_end]),
        }
        self.state = CONTENT
        self.raw: list[str] = []  # raw text of the unfinished call (for the fallback)
        self.call_id: list[str] = []
        self.args: StreamedArgs | None = None
        self.loose: list[str] = []  # text between calls in a section: content unless blank

    def _markers(self) -> MarkerSet:
        return self._sets[self.state]

    def _text(self, text: str, out: list[Event]) -> None:
        if self.state == ARGS:
            assert self.args is not None
            self.args.feed(text, out)
        elif self.state == CALL_ID:
            self.call_id.append(text)
            self.raw.append(text)
        elif self.state == SECTION:
            self.loose.append(text)
        else:
            content(text, out)

    def _marker(self, marker: str, out: list[Event]) -> None:
        state = self.state
        self._flush_loose(out)
        if marker == self.section_start:
            self.state, self.raw = SECTION, [marker]
        elif marker == self.start:
            self.state, self.call_id = CALL_ID, []
            self.raw = (self.raw if state == SECTION else []) + [marker]
        elif state == CALL_ID and marker == self.args_marker:
            name = call_name("".join(self.call_id))
            if name is None:
                self._fail(marker, out)
            else:
                self.raw.append(marker)
                self.args = StreamedArgs(self.sink, name, out)
                self.state = ARGS
        elif state == CALL_ID:  # call end without arguments: not a call we understand
            self._fail(marker, out)
        elif state == ARGS:
            assert self.args is not None
            self.args.end(out)
            self.args, self.raw = None, []
            self.state = SECTION if marker == self.end else CONTENT
        else:  # section end
            self.state, self.raw = CONTENT, []

    def _fail(self, marker: str, out: list[Event]) -> None:
        content("".join(self.raw) + marker, out)
        self.raw, self.state = [], SECTION if marker != self.section_end else CONTENT

    def _flush_loose(self, out: list[Event]) -> None:
        if self.loose:
            text, self.loose = "".join(self.loose), []
            if text.strip():
                content(text, out)

    def finish(self, reason: str, out: list[Event]) -> None:
        self.flush(out)
        self._flush_loose(out)
        if self.args is not None:
            self.args.cut(out)
        elif self.state == CALL_ID:
            content("".join(self.raw), out)
        self.args, self.raw, self.state = None, [], CONTENT


_SECTION = "<|tool_calls_section_begin|>"
_CALL = "<|tool_call_begin|>"
_ARGS = "<|tool_call_argument_begin|>"


class KimiParams(ToolFormatParams):
    MARKER_FIELDS: ClassVar[tuple[str, ...]] = (
        "section_start",
        "start",
        "args_marker",
        "end",
        "section_end",
    )

    format: Literal["kimi"]
    start: str = Field(_CALL, description="Opens a call.")
    end: str = Field("<|tool_call_end|>", description="Closes a call.")
    section_start: str = Field(_SECTION, description="Opens the calls section.")
    section_end: str = Field("<|tool_calls_section_end|>", description="Closes the section.")
    args_marker: str = Field(_ARGS, description="Separates the call id from its arguments.")
    prefill_required: str = Field(_SECTION + _CALL, description="Prompt suffix forcing some call.")
    prefill_function: str = Field(
        _SECTION + _CALL + "functions.{name}:0" + _ARGS,
        description="Prompt suffix forcing a call to {name}.",
    )

    def call_frame(self, name: str) -> CallFrame:
        prefix = f"{self.section_start}{self.start}functions.{name}:0{self.args_marker}"
        return CallFrame(prefix, self.end + self.section_end)

    def calls_layout(self) -> CallsLayout:
        """Each call in a section of its own (the parser reads consecutive sections)."""
        return CallsLayout(self.section_start)


@register_tool_format("kimi", KimiParams)
def kimi_parser(params: KimiParams, sink: CallSink, calls_enabled: bool) -> ToolFormat:
    """Kimi K2: a calls section of `functions.NAME:IDX` calls with JSON arguments."""
    return KimiFormat(
        sink,
        params.start,
        params.end,
        params.section_start,
        params.section_end,
        params.args_marker,
    )
