"""Qwen3-Coder tool calls, XML-style with raw-text values:

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

A call starts at `<function=NAME>`. A value whose parameter is a string streams as it is
generated (a JSON string, one newline after `>` and before `</parameter>` dropped);
any other value is read whole at its end and typed by the tool's schema (numbers,
booleans, objects, arrays; a value that does not fit is passed as written and logged).
`</parameter>` may be missing before the next parameter or `</function>`. A
`<tool_call>` that does not open a function is delivered as the text it was.
"""

from __future__ import annotations

import logging
import re
from typing import Any, ClassVar, Literal

from pydantic import Field

from pipeserve.events import Event, ToolCallArgsDelta, ToolCallEnd
from pipeserve.stages.toolfmt.base import CallSink, MarkerParser, ToolFormat, content
from pipeserve.stages.toolfmt.coerce import (
    coerce_text_value,
    dumps,
    property_schema,
    schema_types,
)
from pipeserve.stages.toolfmt.markers import MarkerSet
from pipeserve.stages.toolfmt.registry import (
    CallsLayout,
    PairFrame,
    ToolFormatParams,
    register_tool_format,
)

log = logging.getLogger("pipeserve.toolfmt")

_FUNC, _FUNC_END = "<function=", "</function>"
_PARAM, _PARAM_END = "<parameter=", "</parameter>"
_NAME = re.compile(r"[^\s<>=]+")
_NAME_SO_FAR = re.compile(r"\s*[^\s<>=]{0,128}\s*")
CONTENT, OPENED, FUNC_NAME, FUNCTION, PARAM_NAME, VALUE = range(6)
_STRING = frozenset(("string",))


class _Call:
    """One function's arguments, emitted as JSON fragments as the parameters arrive."""

    def __init__(self, sink: CallSink, name: str, out: list[Event]) -> None:
        self.name = name
        self.schema = sink.schema(name)
        self.index = sink.start(name, out)
        self.parts: list[str] = []
        self.key = ""
        self.streaming = False  # the current value streams as a JSON string
        self.value: list[str] = []
        self.fresh = True  # no value text yet (a leading newline is dropped)
        self.newline = ""  # a held trailing newline (dropped if the value ends here)

    def emit(self, fragment: str, out: list[Event]) -> None:
        if fragment:
            self.parts.append(fragment)
            out.append(ToolCallArgsDelta(self.index, fragment))

    def open_value(self, key: str, out: list[Event]) -> None:
        self.key = key.strip()
        prop = property_schema(self.schema, self.key)
        self.streaming = schema_types(prop) == _STRING
        self.value, self.fresh, self.newline = [], True, ""
        if self.streaming:
            self.emit(("{" if not self.parts else ", ") + dumps(self.key) + ': "', out)

    def text(self, text: str, out: list[Event]) -> None:
        if self.fresh:
            text = text.removeprefix("\n")
            if not text:
                return
            self.fresh = False
        if not self.streaming:
            self.value.append(text)
            return
        text = self.newline + text
        self.newline = "\n" if text.endswith("\n") else ""
        self.emit(dumps(text[: len(text) - len(self.newline)])[1:-1], out)

    def close_value(self, out: list[Event]) -> None:
        if self.streaming:
            self.emit('"', out)
            self.streaming = False
            return
        raw = "".join(self.value).removesuffix("\n")
        prop = property_schema(self.schema, self.key)
        value: Any = coerce_text_value(raw, prop)
        if isinstance(value, str) and schema_types(prop) not in (None, _STRING):
            log.info("call %s: parameter %r does not fit its schema; passed as written",
                     self.name, self.key)  # fmt: skip
        self.emit(("{" if not self.parts else ", ") + dumps(self.key) + ": " + dumps(value), out)

    def end(self, out: list[Event]) -> None:
        self.emit("}" if self.parts else "{}", out)
        out.append(ToolCallEnd(self.index, "".join(self.parts)))

    def cut(self, out: list[Event]) -> None:
        """Generation stopped inside the call: what was written, unrepaired."""
        if not self.streaming and self.value:
            self.emit("".join(self.value), out)
        out.append(ToolCallEnd(self.index, "".join(self.parts)))


class Qwen3CoderFormat(MarkerParser):
    def __init__(self, sink: CallSink, start: str, end: str) -> None:
        super().__init__()
        self.sink = sink
        self.start, self.end = start, end
        names = MarkerSet([">", end, start])
        self._sets = {
            CONTENT: MarkerSet([start]),
            OPENED: MarkerSet([_FUNC, end, start]),
            FUNC_NAME: names,
            FUNCTION: MarkerSet([_PARAM, _FUNC_END, _FUNC, end]),
            PARAM_NAME: names,
            VALUE: MarkerSet([_PARAM_END, _PARAM, _FUNC_END, end]),
        }
        self.state = CONTENT
        self.raw: list[str] = []  # text of a call not yet started (for the fallback)
        self.name: list[str] = []
        self.call: _Call | None = None

    def _markers(self) -> MarkerSet:
        return self._sets[self.state]

    def _text(self, text: str, out: list[Event]) -> None:
        state = self.state
        if state == CONTENT:
            content(text, out)
        elif state == VALUE:
            assert self.call is not None
            self.call.text(text, out)
        elif state in (FUNC_NAME, PARAM_NAME):
            self.name.append(text)
            self.raw.append(text)
            if state == FUNC_NAME and not _NAME_SO_FAR.fullmatch("".join(self.name)):
                self._fail(out)  # not a function name: the text it was, at once
        elif state == OPENED:
            self.raw.append(text)
            if text.strip():
                self._fail(out)
        # FUNCTION: text between parameters is ignored

    def _marker(self, marker: str, out: list[Event]) -> None:
        state = self.state
        if state == CONTENT and marker != self.start:  # found before a failed call ended
            content(marker, out)
        elif marker == self.start and state in (CONTENT, OPENED, FUNC_NAME):
            if state != CONTENT:
                self._fail(out)
            self.state, self.raw = OPENED, [marker]
        elif state == OPENED and marker == _FUNC:
            self.state, self.name = FUNC_NAME, []
            self.raw.append(marker)
        elif state in (FUNC_NAME, PARAM_NAME):
            self._named(marker, out)
        elif marker == _PARAM:  # FUNCTION or VALUE (a missing </parameter>)
            self._close_value(out)
            self.state, self.name = PARAM_NAME, []
        elif marker == _PARAM_END:
            self._close_value(out)
            self.state = FUNCTION
        elif marker == _FUNC:  # another function in the same <tool_call>
            self._end_call(out)
            self.state, self.name, self.raw = FUNC_NAME, [], [marker]
        else:  # </function> or the end marker
            self._end_call(out)
            self.state = OPENED if marker == _FUNC_END else CONTENT
            self.raw = []

    def _named(self, marker: str, out: list[Event]) -> None:
        name = "".join(self.name).strip()
        if marker != ">" or not _NAME.fullmatch(name):
            self.raw.append(marker)
            self._fail(out) if self.call is None else self._end_call(out)
            self.state = CONTENT if self.call is None else FUNCTION
            return
        if self.state == FUNC_NAME:
            self.call = _Call(self.sink, name, out)
            self.state, self.raw = FUNCTION, []
        else:
            assert self.call is not None
            self.call.open_value(name, out)
            self.state = VALUE

    def _close_value(self, out: list[Event]) -> None:
        if self.state == VALUE and self.call is not None:
            self.call.close_value(out)

    def _end_call(self, out: list[Event]) -> None:
        self._close_value(out)
        if self.call is not None:
            self.call.end(out)
            self.call = None

    def _fail(self, out: list[Event]) -> None:
        """Not a call: the text since `<tool_call>` is delivered as it was."""
        content("".join(self.raw), out)
        self.raw, self.state = [], CONTENT

    def finish(self, reason: str, out: list[Event]) -> None:
        self.flush(out)
        if self.call is not None:
            if self.state == VALUE or self.state == PARAM_NAME:
                self.call.cut(out)
            else:
                self.call.end(out)
            self.call = None
        elif self.raw:
            content("".join(self.raw), out)
        self.raw, self.state = [], CONTENT


class Qwen3CoderParams(ToolFormatParams):
    MARKER_FIELDS: ClassVar[tuple[str, ...]] = ("start", "end")

    format: Literal["qwen3_coder"]
    start: str = Field("<tool_call>", description="Opens a call.")
    end: str = Field("</tool_call>", description="Closes a call.")
    prefill_required: str = Field(
        "<tool_call>\n<function=", description="Prompt suffix forcing some call."
    )
    prefill_function: str = Field(
        "<tool_call>\n<function={name}>\n", description="Prompt suffix forcing a call to {name}."
    )

    def pair_frame(self, name: str) -> PairFrame:
        return PairFrame(
            f"{self.start}\n{_FUNC}{name}>\n",
            f"{_FUNC_END}\n{self.end}",
            _PARAM,
            ">",
            "",
            _PARAM_END,
        )

    def calls_layout(self) -> CallsLayout:
        return CallsLayout(self.start, separator="\n")


@register_tool_format("qwen3_coder", Qwen3CoderParams)
def qwen3_coder_parser(params: Qwen3CoderParams, sink: CallSink, calls_enabled: bool) -> ToolFormat:
    """Qwen3-Coder: `<tool_call><function=NAME><parameter=K>V</parameter></function>`."""
    return Qwen3CoderFormat(sink, params.start, params.end)
