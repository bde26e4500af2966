"""Gemma tool calls, which are prompted (Gemma has no tool tokens): a fenced block

    ```tool_code
    get_weather(city="Paris", days=2)
    ```

(Python call expressions, one per line or a list) or ```` ```json ```` with
`{"name": "f", "parameters": {...}}` (or a list of them); or, as the whole answer, the
list `[get_weather(city="Paris"), ...]` of Google's function-calling prompt. A JSON block streams its
arguments as they are generated (toolfmt/call_array.py); a tool_code block is read
whole at its closing fence. A block counts as calls only when it names the request's
tools, so a code sample in an answer stays text, exactly as written.
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

CONTENT, JSON, CODE, CLOSING, START, PYLIST = range(6)
_NONE = MarkerSet([])


class GemmaFormat(MarkerParser):
    def __init__(self, sink: CallSink, json_start: str, code_start: str, fence: str) -> None:
        super().__init__()
        self.sink = sink
        self.json_start, self.code_start, self.fence = json_start, code_start, fence
        self._open_set = MarkerSet([json_start, code_start])
        self._close_set = MarkerSet([fence])
        self.state = START
        self.calls: CallArray | None = None
        self.code: list[str] = []

    def _markers(self) -> MarkerSet:
        if self.state in (CONTENT, START):
            return self._open_set
        return _NONE if self.state == PYLIST else self._close_set

    def _text(self, text: str, out: list[Event]) -> None:
        if self.state == START:
            self._start(text, out)
        elif self.state == PYLIST:
            self.code.append(text)
        elif self.state == CONTENT:
            content(text, out)
        elif self.state == CODE:
            self.code.append(text)
        elif self.state == JSON:
            assert self.calls is not None
            rest = self.calls.feed(text, out)
            if self.calls.done:
                self.state = CONTENT if self.calls.failed else CLOSING
                self.calls = None
                if rest and self.state == CONTENT:
                    content(rest, out)
        # CLOSING: whitespace before the closing fence

    def _start(self, text: str, out: list[Event]) -> None:
        """The answer's opening: a `[f(...), ...]` list of calls (read whole at the end)
        or text."""
        self.code.append(text)
        buf = "".join(self.code)
        pythonic = python_list_start(buf.lstrip())
        if pythonic is None or not buf.strip():
            return
        if pythonic:
            self.state = PYLIST
        else:
            self.state, self.code = CONTENT, []
            content(buf, out)

    def _marker(self, marker: str, out: list[Event]) -> None:
        if self.state == START:
            self.state, held, self.code = CONTENT, "".join(self.code), []
            content(held, out)
        if self.state == CONTENT:
            if marker == self.json_start:
                self.state = JSON
                self.calls = CallArray(self.sink, marker, known_only=True)
            elif marker == self.code_start:
                self.state, self.code = CODE, [marker]
            else:  # a closing fence found while a failed block was being read
                content(marker, out)
            return
        self._close(marker, out)

    def _close(self, fence: str, out: list[Event]) -> None:
        if self.state in (START, PYLIST):
            self.code = ["", *self.code]  # no opening marker
            self._code(fence or self.fence, out, fence)
        elif self.state == CODE:
            self._code(fence, out)
        elif self.calls is not None:
            self.calls.end(out, cut=not fence)
            if self.calls.failed or (self.calls.calls == 0 and fence):
                content(fence, out)
            self.calls = None
        self.state = CONTENT

    def _code(self, fence: str, out: list[Event], closing: str | None = None) -> None:
        """A tool_code block (or the whole answer as a call list) at its end: calls when
        every name is a request's tool, else the text as written (`closing` after it)."""
        body = "".join(self.code[1:])
        calls = parse_python_calls(body) if fence else None
        if calls is None and fence:
            lines = [line for line in body.splitlines() if line.strip()]
            each = [parse_python_calls(line) for line in lines]
            if lines and all(found is not None for found in each):
                calls = [call for found in each if found for call in found]
        if not calls or not all(self.sink.has(name) for name, _ in calls):
            content("".join(self.code) + (fence if closing is None else closing), out)
        else:
            for name, arguments in calls:
                self.sink.whole(name, arguments, out)
        self.code = []

    def finish(self, reason: str, out: list[Event]) -> None:
        self.flush(out)
        if self.state != CONTENT:
            self._close("", out)
        self.state = CONTENT


_FENCE = "```"


class GemmaParams(ToolFormatParams):
    MARKER_FIELDS: ClassVar[tuple[str, ...]] = ("json_start", "code_start", "fence")

    format: Literal["gemma"]
    json_start: str = Field(_FENCE + "json", description="Opens a JSON calls block.")
    code_start: str = Field(_FENCE + "tool_code", description="Opens a Python calls block.")
    fence: str = Field(_FENCE, description="Closes a block.")
    prefill_required: str = Field(
        _FENCE + 'json\n{"name": "', description="Prompt suffix forcing some call."
    )
    prefill_function: str = Field(
        _FENCE + 'json\n{"name": "{name}", "parameters": ',
        description="Prompt suffix forcing a call to {name}.",
    )

    def call_frame(self, name: str) -> CallFrame:
        prefix = f'{self.json_start}\n{{"name": {json.dumps(name)}, "parameters": '
        return CallFrame(prefix, f"}}\n{self.fence}")

    def calls_layout(self) -> CallsLayout:
        return CallsLayout(self.json_start, separator="\n")


@register_tool_format("gemma", GemmaParams)
def gemma_parser(params: GemmaParams, sink: CallSink, calls_enabled: bool) -> ToolFormat:
    """Gemma: prompted calls in a ```tool_code (Python) or ```json fenced block."""
    return GemmaFormat(sink, params.json_start, params.code_start, params.fence)
