"""DeepSeek V3 / R1 / V3.1 tool calls:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

(V3, R1-0528) or `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` (V3.1).
The call starts once its name is read; the JSON arguments stream through the coercing
streamer, the closing fence is skipped. A call whose head is neither shape is delivered
as the text it was.
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

_FENCED = re.compile(r"\s*([^\s`<>]+)\s*```[A-Za-z]*[ \t]*\n?\s*(?=[{\[])")
_PLAIN_NAME = re.compile(r"\s*([^\s`<>{}]+)\s*")
_HEAD_LIMIT = 256
CONTENT, SECTION, KIND, HEAD, ARGS = range(5)


class DeepSeekFormat(MarkerParser):
    def __init__(self, sink: CallSink, section: str, start: str, sep: str, end: str,
                 section_end: str) -> None:  # fmt: skip
        super().__init__()
        self.sink = sink
        self.section, self.start, self.sep = section, start, sep
        self.end, self.section_end = end, section_end
        self._sets = {
            CONTENT: MarkerSet([section, start]),
            SECTION: MarkerSet([start, section_end]),
            KIND: MarkerSet([sep, end, section_end]),
            HEAD: MarkerSet([end, section_end]),
            ARGS: MarkerSet([end, section_end]),
        }
        self.state = CONTENT
        self.raw: list[str] = []  # the unfinished call's text (for the fallback)
        self.head: list[str] = []
        self.args: StreamedArgs | None = None
        self.failed = False  # a call of this section was delivered as text
        self.loose: list[str] = []  # text between calls in a section

    def _markers(self) -> MarkerSet:
        return self._sets[self.state]

    def _text(self, text: str, out: list[Event]) -> None:
        state = self.state
        if state == ARGS:
            assert self.args is not None
            self.args.feed(text, out)  # the closing fence after the JSON is skipped
        elif state == HEAD:
            self.raw.append(text)
            self.head.append(text)
            self._fenced_head(out)
        elif state == KIND:
            self.raw.append(text)
            self.head.append(text)
        elif state == SECTION:
            self.loose.append(text)
        else:
            content(text, out)

    def _fenced_head(self, out: list[Event]) -> None:
        """V3: `NAME\\n```json\\n` before the JSON arguments."""
        head = "".join(self.head)
        match = _FENCED.match(head)
        if match:
            self._start_args(match.group(1), head[match.end() :], out)
        elif len(head) > _HEAD_LIMIT:
            self._fail("", out)

    def _start_args(self, name: str, rest: str, out: list[Event]) -> None:
        self.args = StreamedArgs(self.sink, name, out)
        self.state, self.head = ARGS, []
        if rest:
            self.args.feed(rest, out)

    def _flush_loose(self, out: list[Event]) -> None:
        """Text between the calls of a section: content unless it is only whitespace."""
        if self.loose:
            text, self.loose = "".join(self.loose), []
            if text.strip():
                content(text, out)

    def _marker(self, marker: str, out: list[Event]) -> None:
        self._flush_loose(out)
        state = self.state
        if marker == self.section:
            self.state, self.raw, self.failed = SECTION, [marker], False
        elif marker == self.start:
            self.raw = (self.raw if state == SECTION else []) + [marker]
            self.state, self.head = KIND, []
        elif state == KIND and marker == self.sep:
            self._kind(marker, out)
        elif state in (KIND, HEAD):
            self._fail(marker, out)
        elif state == ARGS:
            assert self.args is not None
            self.args.end(out)
            self.args, self.raw = None, []
            self.state = SECTION if marker == self.end else CONTENT
        elif marker == self.section_end:
            if self.failed:  # the section held text, not calls: its end is text too
                content(marker, out)
            self.state, self.raw, self.failed = CONTENT, [], False
        else:  # a call end outside a call
            content(marker, out)

    def _kind(self, marker: str, out: list[Event]) -> None:
        """At the separator: `function` (V3: name and fence follow) or the name (V3.1)."""
        kind = "".join(self.head).strip()
        self.raw.append(marker)
        self.head = []
        if kind == "function":
            self.state = HEAD
            return
        match = _PLAIN_NAME.fullmatch(kind)
        if match is None:
            self._fail("", out)
        else:
            self._start_args(match.group(1), "", out)

    def _fail(self, marker: str, out: list[Event]) -> None:
        content("".join(self.raw) + marker, out)
        self.raw, self.head = [], []
        self.state = CONTENT if marker == self.section_end else SECTION
        self.failed = self.state == SECTION

    def finish(self, reason: str, out: list[Event]) -> None:
        self.flush(out)
        self._flush_loose(out)
        if self.args is not None:
            self.args.cut(out)
        elif self.state in (KIND, HEAD):
            content("".join(self.raw), out)
        self.args, self.raw, self.head, self.state = None, [], [], CONTENT


_SECTION = "<｜tool▁calls▁begin｜>"
_CALL = "<｜tool▁call▁begin｜>"
_SEP = "<｜tool▁sep｜>"
_CALL_END = "<｜tool▁call▁end｜>"
_SECTION_END = "<｜tool▁calls▁end｜>"


class DeepSeekParams(ToolFormatParams):
    MARKER_FIELDS: ClassVar[tuple[str, ...]] = (
        "section_start",
        "start",
        "sep",
        "end",
        "section_end",
    )

    format: Literal["deepseek"]
    section_start: str = Field(_SECTION, description="Opens the calls section.")
    start: str = Field(_CALL, description="Opens a call.")
    sep: str = Field(_SEP, description="Separates the call type (or name) from the rest.")
    end: str = Field(_CALL_END, description="Closes a call.")
    section_end: str = Field(_SECTION_END, description="Closes the calls section.")
    prefill_required: str = Field(
        _SECTION + _CALL + "function" + _SEP, description="Prompt suffix forcing some call."
    )
    prefill_function: str = Field(
        _SECTION + _CALL + "function" + _SEP + "{name}\n```json\n",
        description="Prompt suffix forcing a call to {name}.",
    )

    def call_frame(self, name: str) -> CallFrame:
        prefix = f"{self.section_start}{self.start}function{self.sep}{name}\n```json\n"
        return CallFrame(prefix, f"\n```{self.end}{self.section_end}")

    def calls_layout(self) -> CallsLayout:
        """Each call in a section of its own (the parser reads consecutive sections)."""
        return CallsLayout(self.section_start)


@register_tool_format("deepseek", DeepSeekParams)
def deepseek_parser(params: DeepSeekParams, sink: CallSink, calls_enabled: bool) -> ToolFormat:
    """DeepSeek V3/R1/V3.1: `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` + fenced JSON."""
    return DeepSeekFormat(
        sink, params.section_start, params.start, params.sep, params.end, params.section_end
    )
