"""Calls written as JSON objects: `[{"name": N, "arguments": {...}}, ...]`, a single
object, or objects separated by `;` (Mistral's array, Phi-4-mini, Granite, Llama 3).

`CallArray` reads the text after a format's call marker as it streams. As soon as an
element's head `{"name": "f", "arguments": ` has arrived the call starts and its
arguments stream through the coercing JSON streamer; keys after the arguments (an
`id`) are skipped. An element in any other shape (keys in another order, the
`{"type": "function", "function": {...}}` wrapper) is buffered to its closing brace and
parsed in one piece. Text that is not such JSON fails the parse: what was not yet part
of a call is handed back to the format, which delivers it as the text it was.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pipeserve.events import Event
from pipeserve.stages.toolfmt.base import CallSink, StreamedArgs, content, json_call
from pipeserve.stages.toolfmt.json_stream import JsonDepth

_NAME = r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"'
_HEAD = re.compile(r"\s*\{\s*" + _NAME + r'\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')
_KEY = re.compile(r'\s*\{\s*"((?:[^"\\]|\\.)*)"\s*:')
_SECOND_KEY = re.compile(r"\s*\{\s*" + _NAME + r'\s*,\s*"((?:[^"\\]|\\.)*)"\s*:')
_WS = " \t\r\n"
_HEAD_LIMIT = 512
OPEN, ELEMENT, HEAD, ARGS, TAIL, WHOLE, AFTER, DONE = range(8)


def element_call(text: str) -> tuple[str, Any] | None:
    """(name, arguments) of one call object in any accepted shape, else None."""
    try:
        item = json.loads(text, strict=False)
    except ValueError:
        return None
    if isinstance(item, dict) and isinstance(item.get("function"), dict):
        item = item["function"]  # {"type": "function", "function": {...}}
    return json_call(item)


class CallArray:
    """The calls after one call marker. feed() returns the text after the calls once they
    are complete; text that turns out not to be calls is emitted as content (from the
    marker on) and `failed` is set."""

    def __init__(
        self,
        sink: CallSink,
        marker: str,
        *,
        semicolons: bool = False,
        known_only: bool = False,
    ) -> None:
        self.sink = sink
        self.semicolons = semicolons  # `{..}; {..}` (Llama 3)
        self.known_only = known_only  # a call to a tool the request lacks is text
        self.pending: list[str] = [marker]  # raw text not yet part of a call
        self.state = OPEN
        self.array = False
        self.head = ""
        self.depth = JsonDepth(0)
        self.args: StreamedArgs | None = None
        self.calls = 0
        self.failed = False
        self.carry = ""  # whitespace read after the calls, returned with the text after them

    @property
    def done(self) -> bool:
        return self.state == DONE

    def feed(self, text: str, out: list[Event]) -> str:
        """Consume `text`; returns what follows the calls once they are complete."""
        i, n = 0, len(text)
        while i < n and self.state != DONE:
            i = self._step(text, i, out)
        rest, self.carry = self.carry + text[i:], ""
        return rest

    def _step(self, text: str, i: int, out: list[Event]) -> int:
        state = self.state
        if state in (HEAD, WHOLE):
            return self._object(text, i, out)
        if state == ARGS:
            return self._args(text, i, out)
        if state == TAIL:
            end = self.depth.scan(text[i:])
            if end == -1:
                return len(text)
            self.state = AFTER if self.array or self.semicolons else DONE
            return i + end
        ch = text[i]
        if ch in _WS:
            self.pending.append(ch)
            return i + 1
        return self._punctuation(ch, text, i, out)

    def _punctuation(self, ch: str, text: str, i: int, out: list[Event]) -> int:
        state = self.state
        if state == OPEN and ch == "[":
            self.array, self.state = True, ELEMENT
            self.pending.append(ch)
            return i + 1
        if ch == "{" and state in (OPEN, ELEMENT):
            self.state, self.head, self.depth = HEAD, "", JsonDepth(0)
            return i
        if state == ELEMENT and self.array and ch == "]" and not self.calls:
            self.state = DONE
            return i + 1
        if state == AFTER:
            if self.array and ch == ",":
                self.state = ELEMENT
                self.pending.append(ch)
                return i + 1
            if self.array and ch == "]":
                self.state = DONE
                return i + 1
            if not self.array and ch == ";":
                self.state = ELEMENT
                self.pending = [ch]
                return i + 1
            if not self.array:  # text after the calls (with the whitespace before it)
                self.state, self.carry = DONE, "".join(self.pending)
                return i
        return self._fail(text, i, out)

    def _object(self, text: str, i: int, out: list[Event]) -> int:
        piece = text[i:]
        end = self.depth.scan(piece)
        taken = piece if end == -1 else piece[:end]
        before = len(self.head)  # head text from earlier pieces
        self.head += taken
        if self.state == HEAD:
            start = self._head(out)
            if start == -1:
                return self._fail_head(text, i, taken, out)
            if start is not None:  # the arguments begin here: stream from there on
                return i + max(0, start - before)
        if end == -1:
            return len(text)
        call = element_call(self.head)
        if call is None or (self.known_only and not self.sink.has(call[0])):
            return self._fail_head(text, i, taken, out)
        self.sink.whole(call[0], call[1], out)
        self._committed()
        return i + end

    def _head(self, out: list[Event]) -> int | None:
        """Where in the head the arguments begin once it names the call (the call then
        starts), -1 when it names a tool that must not be called, None to keep reading."""
        match = _HEAD.match(self.head)
        if match:
            name = json.loads('"' + match.group(1) + '"', strict=False)
            if self.known_only and not self.sink.has(name):
                return -1
            self.args = StreamedArgs(self.sink, name, out)
            self.calls += 1
            self.pending, self.state = [], ARGS
            return match.end()
        if not self._may_stream():
            self.state = WHOLE
        return None

    def _may_stream(self) -> bool:
        head = self.head
        if len(head) > _HEAD_LIMIT:
            return False
        first = _KEY.match(head)
        if first is not None and first.group(1) != "name":
            return False
        second = _SECOND_KEY.match(head)
        return second is None or second.group(2) in ("arguments", "parameters")

    def _args(self, text: str, i: int, out: list[Event]) -> int:
        rest = self._feed_args(text[i:], out)
        return len(text) - len(rest)

    def _feed_args(self, text: str, out: list[Event]) -> str:
        assert self.args is not None
        rest = self.args.feed(text, out)
        if self.args.done:
            self.args.end(out)
            self.args = None
            self.state, self.depth = TAIL, JsonDepth(1)
        return rest

    def _committed(self) -> None:
        self.calls += 1
        self.pending = []
        self.state = AFTER if self.array or self.semicolons else DONE

    def _fail_head(self, text: str, i: int, taken: str, out: list[Event]) -> int:
        self.pending.append(self.head[: len(self.head) - len(taken)])
        return self._fail(text, i, out)

    def _fail(self, text: str, i: int, out: list[Event]) -> int:
        """Not a call: the unparsed text and the rest of this piece become content."""
        content("".join(self.pending) + text[i:], out)
        self.pending, self.failed, self.state = [], True, DONE
        return len(text)

    def end(self, out: list[Event], cut: bool) -> None:
        """The calls ended (an end marker, or generation stopped when `cut`)."""
        if self.args is not None:
            if cut:
                self.args.cut(out)
            else:
                self.args.end(out)
            self.args = None
        elif self.state in (OPEN, ELEMENT, HEAD, WHOLE) and not self.failed:
            text = "".join(self.pending) + (self.head if self.state in (HEAD, WHOLE) else "")
            if self.calls == 0:
                content(text, out)
            elif text.strip(_WS + ",;"):
                content(text.lstrip(_WS + ",;"), out)
        self.pending, self.state = [], DONE
