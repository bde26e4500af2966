"""Qwen / Hermes tool calls: `<tool_call>{"name": "f", "arguments": {...}}</tool_call>`.

As soon as `{"name": "f", "arguments": ` has arrived the call starts and its arguments
stream through the coercing JSON streamer. Any other shape (keys in another order, a
list of calls) is buffered to the end marker and parsed in one piece; what does not
parse at all is delivered as the raw text it was.
"""

from __future__ import annotations

import json
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
    parse_json_calls,
)
from pipeserve.stages.toolfmt.markers import MarkerSet
from pipeserve.stages.toolfmt.registry import (
    CallFrame,
    CallsLayout,
    ToolFormatParams,
    json_call_frame,
    register_tool_format,
)

_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)'
)
_HEAD_LIMIT = 512  # a head this long that never matched: buffer the call whole
HEAD, ARGS, WHOLE = range(3)


def _strip_outer_brace(raw: str) -> str:
    """Unparsed arguments text still carries the enclosing object's closing brace."""
    text = raw.rstrip()
    return text[:-1] if text.endswith("}") else raw


class _Call:
    def __init__(self, sink: CallSink, start: str) -> None:
        self.sink = sink
        self.raw = [start]
        self.head = ""
        self.mode = HEAD
        self.args: StreamedArgs | None = None

    def feed(self, text: str, out: list[Event]) -> None:
        self.raw.append(text)
        if self.mode == ARGS:
            assert self.args is not None
            self.args.feed(text, out)
        elif self.mode == HEAD:
            self.head += text
            match = _HEAD.match(self.head)
            if match:
                self.mode = ARGS
                name = json.loads('"' + match.group(1) + '"', strict=False)
                self.args = StreamedArgs(self.sink, name, out)
                self.args.feed(self.head[match.end() :], out)
            elif len(self.head) > _HEAD_LIMIT or self.head.lstrip()[:1] not in ("", "{", "["):
                self.mode = WHOLE

    def end(self, end_marker: str, out: list[Event]) -> None:
        """The end marker arrived."""
        if self.args is not None:
            self.args.end(out, _strip_outer_brace)
        else:
            self._whole(end_marker, out)

    def cut(self, out: list[Event]) -> None:
        """Generation ended before the end marker."""
        if self.args is not None:
            self.args.cut(out)
        else:
            self._whole("", out)

    def _whole(self, end_marker: str, out: list[Event]) -> None:
        calls = parse_json_calls("".join(self.raw[1:]))
        if calls is None:
            content("".join(self.raw) + end_marker, out)
            return
        for name, arguments in calls:
            self.sink.whole(name, arguments, out)


class JsonFormat(MarkerParser):
    def __init__(self, sink: CallSink, start: str, end: str) -> None:
        super().__init__()
        self.sink = sink
        self.start, self.end = start, end
        self._start_set, self._end_set = MarkerSet([start]), MarkerSet([end])
        self.call: _Call | None = None

    def _markers(self) -> MarkerSet:
        return self._end_set if self.call is not None else self._start_set

    def _text(self, text: str, out: list[Event]) -> None:
        if self.call is None:
            content(text, out)
        else:
            self.call.feed(text, out)

    def _marker(self, marker: str, out: list[Event]) -> None:
        if self.call is None:
            self.call = _Call(self.sink, marker)
        else:
            self.call.end(marker, out)
            self.call = None

    def finish(self, reason: str, out: list[Event]) -> None:
        self.flush(out)
        if self.call is not None:
            self.call.cut(out)
            self.call = None


class JsonParams(ToolFormatParams):
    MARKER_FIELDS: ClassVar[tuple[str, ...]] = ("start", "end")

    format: Literal["json"]
    start: str = Field("<tool_call>", description="Opens a call.")
    end: str = Field("</tool_call>", description="Closes a call.")
    prefill_required: str = Field("<tool_call>\n", description="Prompt suffix forcing some call.")
    prefill_function: str = Field(
        '<tool_call>\n{"name": "{name}", "arguments": ',
        description="Prompt suffix forcing a call to {name}.",
    )

    def call_frame(self, name: str) -> CallFrame:
        return json_call_frame(self.start, self.end, name)

    def calls_layout(self) -> CallsLayout:
        return CallsLayout(self.start, separator="\n")


@register_tool_format("json", JsonParams)
def json_parser(params: JsonParams, sink: CallSink, calls_enabled: bool) -> ToolFormat:
    """Qwen / Hermes: `<tool_call>{"name": .., "arguments": {..}}</tool_call>`."""
    return JsonFormat(sink, params.start, params.end)
