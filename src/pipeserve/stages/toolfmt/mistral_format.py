"""Mistral / Devstral / Magistral tool calls, both writing styles:

- `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` (tokenizers before v11), the
  array streaming element by element (toolfmt/call_array.py);
- `[TOOL_CALLS]f[ARGS]{...}` (v11+ tokenizers), one marker per call, optionally
  `[CALL_ID]id` before `[ARGS]`; the JSON arguments stream as they are generated.

A call whose name is not a plain function name, or text that is neither style, is
delivered as the text it was. Magistral's `[THINK]...[/THINK]` is the thinking stage's.
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
from pipeserve.stages.toolfmt.call_array import CallArray
from pipeserve.stages.toolfmt.markers import MarkerSet
from pipeserve.stages.toolfmt.registry import (
    CallFrame,
    CallsLayout,
    ToolFormatParams,
    register_tool_format,
)

_NAME = re.compile(r"\s*([A-Za-z0-9_.:-]+)\s*")
_NAME_SO_FAR = re.compile(r"\s*[A-Za-z0-9_.:-]{0,128}\s*")  # can still become a name
CONTENT, OPENED, NAME, CALL_ID, ARGS, ARRAY = range(6)


class MistralFormat(MarkerParser):
    def __init__(self, sink: CallSink, start: str, args_marker: str, call_id: str) -> None:
        super().__init__()
        self.sink = sink
        self.start, self.args_marker, self.call_id = start, args_marker, call_id
        self._sets = {
            CONTENT: MarkerSet([start]),
            OPENED: MarkerSet([start, args_marker, call_id]),
            NAME: MarkerSet([start, args_marker, call_id]),
            CALL_ID: MarkerSet([start, args_marker]),
        }
        self.state = CONTENT
        self.raw: list[str] = []  # the unfinished call's text (for the fallback)
        self.args: StreamedArgs | None = None
        self.array: CallArray | None = None

    def _markers(self) -> MarkerSet:
        return self._sets.get(self.state, self._sets[CONTENT])

    def _text(self, text: str, out: list[Event]) -> None:
        state = self.state
        if state == ARGS:
            assert self.args is not None
            rest = self.args.feed(text, out)
            if self.args.done:
                self._end_args(out)
                content(rest, out)
        elif state == ARRAY:
            assert self.array is not None
            rest = self.array.feed(text, out)
            if self.array.done:
                self.array, self.state = None, CONTENT
                content(rest, out)
        elif state == OPENED:
            self._opened(text, out)
        elif state == NAME:
            self._name_text_grows(text, out)
        elif state == CALL_ID:
            self.raw.append(text)
        else:
            content(text, out)

    def _opened(self, text: str, out: list[Event]) -> None:
        """Right after the marker: an array or object of calls, or a call's name."""
        body = text.lstrip()
        if not body:
            self.raw.append(text)
        elif body[0] in "[{":
            self.array = CallArray(self.sink, "".join(self.raw) + text[: len(text) - len(body)])
            self.state, self.raw = ARRAY, []
            self._text(body, out)
        else:
            self.state = NAME
            self._name_text_grows(text, out)

    def _name_text_grows(self, text: str, out: list[Event]) -> None:
        """Text after the marker that can no longer be a name is text, at once."""
        self.raw.append(text)
        if not _NAME_SO_FAR.fullmatch("".join(self.raw[1:])):
            content("".join(self.raw), out)
            self.state, self.raw = CONTENT, []

    def _marker(self, marker: str, out: list[Event]) -> None:
        state = self.state
        if marker == self.start:
            self._close(out, cut=False)
            self.state, self.raw = OPENED, [marker]
            return
        name = _NAME.fullmatch("".join(self.raw[1:]) if state == NAME else self._name_text())
        if marker == self.call_id and state == NAME and name:
            self.raw.append(marker)
            self.state = CALL_ID
        elif marker == self.args_marker and name:
            self.args = StreamedArgs(self.sink, name.group(1), out)
            self.state, self.raw = ARGS, []
        else:  # not a call we understand
            content("".join(self.raw) + marker, out)
            self.state, self.raw = CONTENT, []

    def _name_text(self) -> str:
        """The name written before `[CALL_ID]`."""
        parts = self.raw[1:]
        return "".join(parts[: parts.index(self.call_id)]) if self.call_id in parts else ""

    def _end_args(self, out: list[Event]) -> None:
        assert self.args is not None
        self.args.end(out)
        self.args, self.state = None, CONTENT

    def _close(self, out: list[Event], cut: bool) -> None:
        if self.args is not None:
            if cut:
                self.args.cut(out)
                self.args, self.state = None, CONTENT
            else:
                self._end_args(out)
        elif self.array is not None:
            self.array.end(out, cut)
            self.array = None
        elif self.raw:
            content("".join(self.raw), out)
        self.state, self.raw = CONTENT, []

    def finish(self, reason: str, out: list[Event]) -> None:
        self.flush(out)
        self._close(out, cut=True)


_START, _ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralParams(ToolFormatParams):
    MARKER_FIELDS: ClassVar[tuple[str, ...]] = ("start", "args_marker", "call_id")

    format: Literal["mistral"]
    start: str = Field(_START, description="Opens calls: a JSON array, or NAME[ARGS]{json}.")
    args_marker: str = Field(_ARGS, description="Separates a call's name from its arguments.")
    call_id: str = Field("[CALL_ID]", description="Precedes a call id before the arguments.")
    prefill_required: str = Field(_START, description="Prompt suffix forcing some call.")
    prefill_function: str = Field(
        _START + "{name}" + _ARGS, description="Prompt suffix forcing a call to {name}."
    )

    def call_frame(self, name: str) -> CallFrame:
        return CallFrame(f"{self.start}{name}{self.args_marker}", "")

    def calls_layout(self) -> CallsLayout:
        return CallsLayout(self.start)


@register_tool_format("mistral", MistralParams)
def mistral_parser(params: MistralParams, sink: CallSink, calls_enabled: bool) -> ToolFormat:
    """Mistral: `[TOOL_CALLS][{..}]` or `[TOOL_CALLS]NAME[ARGS]{..}` (v11+)."""
    return MistralFormat(sink, params.start, params.args_marker, params.call_id)
