"""Stream one JSON value (tool-call arguments) while coercing it to a JSON schema.

The streamer re-serializes the value as it arrives: structure and strings the schema
allows are emitted at once; a leaf whose type coercion may change (a string where the
schema wants a number, any number or literal, a container where a string is expected)
is held until complete and emitted in its coerced form. So the fragments, concatenated,
are exactly the final arguments text. Whitespace between tokens is normalized to the
`json.dumps` style. Each character is looked at once (strings are scanned with a regex).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pipeserve.stages.toolfmt.coerce import (
    coerce,
    dumps,
    items_schema,
    property_schema,
    schema_types,
)

_WS = " \t\r\n"
_STR_SPECIAL = re.compile(r'["\\\x00-\x1f]')
_QUOTE_OR_BS = re.compile(r'["\\]')
_SCALAR_END = re.compile(r"[,\]}\s]")
_ESCAPABLE = frozenset('"\\/bfnrtu')
_CONTROL = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}
_LITERALS = {"True": True, "False": False, "None": None}

# Frame states
KEY_OR_END, KEY, COLON, VALUE, COMMA_OR_END = range(5)
ITEM_OR_END, ITEM, ITEM_COMMA_OR_END = range(5, 8)


class _Frame:
    __slots__ = ("is_obj", "schema", "member", "state", "count")

    def __init__(self, is_obj: bool, schema: Any) -> None:
        self.is_obj = is_obj
        self.schema = schema
        self.member: Any = None if is_obj else items_schema(schema)
        self.state = KEY_OR_END if is_obj else ITEM_OR_END
        self.count = 0


class JsonDepth:
    """Finds where one JSON container closes as its text arrives in pieces (strings and
    escapes respected); starts inside `depth` open containers."""

    __slots__ = ("depth", "in_str", "esc")

    def __init__(self, depth: int = 1) -> None:
        self.depth, self.in_str, self.esc = depth, False, False

    def scan(self, text: str) -> int:
        """Index just past the closing bracket in `text`, or -1 (not yet closed)."""
        for i, ch in enumerate(text):
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return -1


class _Capture:
    """A value (or key) held until complete: kind k=key, s=string, c=container, p=scalar."""

    __slots__ = ("kind", "schema", "parts", "esc", "container")

    def __init__(self, kind: str, schema: Any, first: str) -> None:
        self.kind = kind
        self.schema = schema
        self.parts = [first]
        self.esc = False  # a string's last piece ended in a backslash
        self.container = JsonDepth()


class JsonStreamer:
    """feed(text) -> (fragment, leftover after the value); close() at the end of the call."""

    def __init__(self, schema: Any) -> None:
        self.schema = schema
        self.done = False
        self.failed = False
        self._stack: list[_Frame] = []
        self._cap: _Capture | None = None
        self._in_string = False
        self._escape = False
        self._raw: list[str] = []  # unparsed text after a failure

    def feed(self, text: str) -> tuple[str, str]:
        if self.done:
            return "", text
        if self.failed:
            self._raw.append(text)
            return "", ""
        out: list[str] = []
        i, n = 0, len(text)
        while i < n and not self.done:
            if self._cap is not None:
                i = self._capture_more(text, i, out)
            elif self._in_string:
                i = self._string_more(text, i, out)
            elif text[i] in _WS:
                i += 1
            elif self._structural(text[i], out):
                i += 1
            else:
                self._fail(text[i:])
                break
            if self.failed:
                break
        return "".join(out), (text[i:] if self.done else "")

    def raw_tail(self) -> str:
        """Text that was not emitted: everything after a failure, or a held partial value."""
        held = "".join(self._cap.parts) if self._cap is not None else ""
        return "".join(self._raw) if self.failed else held + ("\\" if self._escape else "")

    def close(self) -> str:
        """Complete an unfinished value at the end of the call (repairs missing closers)."""
        if self.done or self.failed:
            return ""
        out: list[str] = []
        cap = self._cap
        if cap is not None:
            if cap.kind == "s":
                cap.parts.append('"')
            if cap.kind in ("s", "p"):
                self._finish_capture(out)
            else:
                self._cap = None  # an unfinished key or container: dropped by the repair
                if cap.kind == "c":
                    out.append("null" if self._pending_value() else "")
                    self._value_done()
        if self.failed:
            return "".join(out)
        if self._in_string:
            out.append('"')
            self._in_string = False
            self._value_done()
        if not self._stack and not self.done:
            out.append("{}")  # nothing at all was written
        if self._stack and self._stack[-1].state in (COLON, VALUE):
            out.append("null")
        for frame in reversed(self._stack):
            out.append("}" if frame.is_obj else "]")
        self._stack.clear()
        self.done = True
        return "".join(out)

    # -- structure -------------------------------------------------------------------

    def _pending_value(self) -> bool:
        return bool(self._stack) and self._stack[-1].state in (COLON, VALUE)

    def _structural(self, c: str, out: list[str]) -> bool:
        if not self._stack:
            return self._begin_value(c, self.schema, out)
        frame = self._stack[-1]
        state = frame.state
        if state == KEY_OR_END or state == KEY:
            if c == '"':
                self._cap = _Capture("k", None, '"')
                return True
            return c == "}" and self._close(out)
        if state == COLON:
            if c == ":":
                frame.state = VALUE
                return True
            return False
        if state == VALUE:
            return self._begin_value(c, frame.member, out)
        if state == COMMA_OR_END or state == ITEM_COMMA_OR_END:
            if c == ",":
                frame.state = KEY if frame.is_obj else ITEM
                return True
            return c == ("}" if frame.is_obj else "]") and self._close(out)
        if c == "]":
            return self._close(out)
        if frame.count and c not in ",:}":
            out.append(", ")
        return self._begin_value(c, frame.member, out)

    def _begin_value(self, c: str, schema: Any, out: list[str]) -> bool:
        types = schema_types(schema)
        if c == "{" or c == "[":
            kind = "object" if c == "{" else "array"
            if types is None or kind in types:
                out.append(c)
                self._stack.append(_Frame(c == "{", schema))
            else:
                self._cap = _Capture("c", schema, c)
            return True
        if c == '"':
            if types is None or "string" in types:
                out.append('"')
                self._in_string = True
            else:
                self._cap = _Capture("s", schema, '"')
            return True
        if c in ",:]}":
            return False
        self._cap = _Capture("p", schema, c)
        return True

    def _close(self, out: list[str]) -> bool:
        out.append("}" if self._stack.pop().is_obj else "]")
        self._value_done()
        return True

    def _value_done(self) -> None:
        if not self._stack:
            self.done = True
            return
        frame = self._stack[-1]
        frame.state = COMMA_OR_END if frame.is_obj else ITEM_COMMA_OR_END
        frame.count += 1

    def _fail(self, rest: str) -> None:
        self.failed = True
        held = "".join(self._cap.parts) if self._cap is not None else ""
        self._raw = [held, rest]
        self._cap = None

    # -- strings and held values -------------------------------------------------------

    def _string_more(self, text: str, i: int, out: list[str]) -> int:
        n = len(text)
        while i < n:
            if self._escape:
                c = text[i]
                self._escape = False
                out.append("\\" + c if c in _ESCAPABLE else "\\\\" + c)
                i += 1
                continue
            m = _STR_SPECIAL.search(text, i)
            if m is None:
                out.append(text[i:])
                return n
            k = m.start()
            if k > i:
                out.append(text[i:k])
            ch = text[k]
            if ch == '"':
                out.append('"')
                self._in_string = False
                self._value_done()
                return k + 1
            if ch == "\\":
                self._escape = True
            else:
                out.append(_CONTROL.get(ch) or f"\\u{ord(ch):04x}")
            i = k + 1
        return n

    def _capture_more(self, text: str, i: int, out: list[str]) -> int:
        cap = self._cap
        assert cap is not None
        n = len(text)
        if cap.kind == "p":
            m = _SCALAR_END.search(text, i)
            end = m.start() if m else n
            cap.parts.append(text[i:end])
            if m:
                self._finish_capture(out)
            return end
        if cap.kind == "c":
            return self._container_more(cap, text, i, out)
        j = i
        if cap.esc and j < n:
            cap.esc = False
            j += 1
        while True:
            m = _QUOTE_OR_BS.search(text, j)
            if m is None:
                cap.parts.append(text[i:])
                return n
            k = m.start()
            if text[k] == "\\":
                if k + 1 < n:
                    j = k + 2
                    continue
                cap.esc = True
                cap.parts.append(text[i:])
                return n
            cap.parts.append(text[i : k + 1])
            self._finish_capture(out)
            return k + 1

    def _container_more(self, cap: _Capture, text: str, i: int, out: list[str]) -> int:
        end = cap.container.scan(text[i:])
        if end < 0:
            cap.parts.append(text[i:])
            return len(text)
        cap.parts.append(text[i : i + end])
        self._finish_capture(out)
        return i + end

    def _finish_capture(self, out: list[str]) -> None:
        cap = self._cap
        assert cap is not None
        raw = "".join(cap.parts)
        try:
            value = json.loads(raw, strict=False)
        except ValueError:
            if cap.kind != "p":
                self._fail("")
                return
            value = _LITERALS.get(raw, raw)  # a bare word: read as the text it is
        self._cap = None
        if cap.kind == "k":
            frame = self._stack[-1]
            frame.member = property_schema(frame.schema, str(value))
            out.append((", " if frame.count else "") + dumps(str(value)) + ": ")
            frame.state = COLON
            return
        out.append(dumps(coerce(value, cap.schema)))
        self._value_done()
