"""Llama 3.1 / 3.2 / 3.3 tool calls: `{"name": "f", "parameters": {...}}` as the whole
message or after `<|python_tag|>`, several separated by `;`; built-in tools as
`<|python_tag|>brave_search.call(query="...")`; Llama 3.2's pythonic list
`[get_weather(city="Paris"), ...]` as the whole message (read at its end).

A message that opens with `{` is read as calls (toolfmt/call_array.py: the call starts
at its name and the arguments stream) only while it names one of the request's tools,
so a JSON answer is never taken for a call. After `<|python_tag|>` any name is a call;
text there that is neither JSON nor a built-in call is delivered as the text it was.
A pythonic list counts as calls only when every name is one of the request's tools.
The turn ends with `<|eom_id|>` / `<|eot_id|>` (end-of-sequence tokens).
"""

from __future__ import annotations

import json
from typing import ClassVar, Literal

from pydantic import Field

from pipeserve.events import Event
from pipeserve.stages.toolfmt.base import CallSink, MarkerParser, ToolFormat, content
from pipeserve.stages.toolfmt.call_array import CallArray
from pipeserve.stages.toolfmt.markers import MarkerSet
from pipeserve.stages.toolfmt.pycall import parse_python_calls, python_list_start
from pipeserve.stages.toolfmt.registry import (
    CallFrame,
    CallsLayout,
    ToolFormatParams,
    register_tool_format,
)

START, CONTENT, TAGGED, CODE = range(4)


def _opening_kind(body: str) -> str | None:
    """json, python (a `[f(...)]` list, Llama 3.2's pythonic calls), text, or None
    while a lone `[` does not tell yet."""
    if body[0] == "{" or body[:1] == "[" and body[1:].lstrip()[:1] in ("{", "]"):
        return "json"
    pythonic = python_list_start(body)
    if pythonic is None:
        return None
    return "python" if pythonic else "text"


class Llama3Format(MarkerParser):
    def __init__(self, sink: CallSink, tag: str) -> None:
        super().__init__()
        self.sink = sink
        self._set = MarkerSet([tag])
        self.state = START
        self.lead: list[str] = []  # the opening text until it tells calls from text
        self.tag = ""  # the tag that opened it
        self.calls: CallArray | None = None
        self.code: list[str] = []
        self.known_only = False  # python calls without the tag must name the request's tools

    def _markers(self) -> MarkerSet:
        return self._set

    def _text(self, text: str, out: list[Event]) -> None:
        if self.calls is not None:
            rest = self.calls.feed(text, out)
            if self.calls.done:
                self.calls, self.state = None, CONTENT
                if rest:
                    content(rest, out)
        elif self.state == CODE:
            self.code.append(text)
        elif self.state in (START, TAGGED):
            self._opening(text, out)
        else:
            content(text, out)

    def _opening(self, text: str, out: list[Event]) -> None:
        """The first text of the answer, or after the tag: calls, code or plain text."""
        self.lead.append(text)
        buf = "".join(self.lead)
        body = buf.lstrip()
        if not body:
            return
        kind = _opening_kind(body)
        if kind is None:
            return  # `[` alone: JSON or Python calls follow, or text
        lead, tag = self.tag + buf[: len(buf) - len(body)], self.tag
        self.lead, self.tag = [], ""
        tagged = self.state == TAGGED
        if kind == "json":
            self.calls = CallArray(self.sink, lead, semicolons=True, known_only=not tagged)
            self._text(body, out)
        elif kind == "python" or tagged:
            self.state, self.code, self.known_only = CODE, [lead, body], not tagged
        else:
            self.state = CONTENT
            content(tag + buf, out)

    def _marker(self, marker: str, out: list[Event]) -> None:
        self._close(out, cut=False)
        self.state, self.tag = TAGGED, marker

    def _close(self, out: list[Event], cut: bool) -> None:
        if self.calls is not None:
            self.calls.end(out, cut)
            self.calls = None
        elif self.state == CODE:
            self._code(out)
        elif self.lead or self.tag:
            content(self.tag + "".join(self.lead), out)
        self.state, self.lead, self.tag = CONTENT, [], ""

    def _code(self, out: list[Event]) -> None:
        """Text after the tag that is not JSON: built-in tool calls, else text."""
        text = "".join(self.code[1:])
        calls = parse_python_calls(text)
        if calls is not None and self.known_only:
            calls = calls if all(self.sink.has(name) for name, _ in calls) else None
        if calls is None:
            content("".join(self.code), out)
        else:
            for name, arguments in calls:
                self.sink.whole(name, arguments, out)
        self.code = []

    def finish(self, reason: str, out: list[Event]) -> None:
        self.flush(out)
        self._close(out, cut=True)


_TAG = "<|python_tag|>"


class Llama3Params(ToolFormatParams):
    MARKER_FIELDS: ClassVar[tuple[str, ...]] = ("tag",)

    format: Literal["llama3"]
    tag: str = Field(_TAG, description="Opens calls (JSON, or a built-in tool's call).")
    prefill_required: str = Field(
        _TAG + '{"name": "', description="Prompt suffix forcing some call."
    )
    prefill_function: str = Field(
        _TAG + '{"name": "{name}", "parameters": ',
        description="Prompt suffix forcing a call to {name}.",
    )

    def call_frame(self, name: str) -> CallFrame:
        """A forced or grammar-checked call is written after the tag (the whole-message
        form cannot follow text)."""
        return CallFrame(f'{self.tag}{{"name": {json.dumps(name)}, "parameters": ', "}")

    def calls_layout(self) -> CallsLayout:
        return CallsLayout(self.tag, separator="; ")


@register_tool_format("llama3", Llama3Params)
def llama3_parser(params: Llama3Params, sink: CallSink, calls_enabled: bool) -> ToolFormat:
    """Llama 3.x: `{"name": .., "parameters": {..}}` (whole message or after <|python_tag|>)."""
    return Llama3Format(sink, params.tag)
