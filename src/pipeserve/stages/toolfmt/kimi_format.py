"""Kimi K2 tool calls:
`<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
<|tool_call_argument_begin|>{json}<|tool_call_end|>...<|tool_calls_section_end|>`.

The call starts when its id is complete; the JSON arguments stream through the coercing
streamer. A call whose id does not name a function is delivered as its raw text.
"""

from __future__ import annotations

import re

from pipeserve.events import Event
from pipeserve.stages.toolfmt.base import CallSink, MarkerParser, StreamedArgs, content
from pipeserve.stages.toolfmt.markers import MarkerSet

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
