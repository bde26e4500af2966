"""The text parser shared by formats whose calls are a JSON array after a start marker
(Phi-4-mini `<|tool_call|>[...]<|/tool_call|>`, Granite `<|tool_call|>[...]`).

After the start marker the calls stream through `CallArray`; an end marker (where the
format has one) right after the calls is dropped, elsewhere it is text. Text that does
not parse as calls is delivered as the text it was, marker included.
"""

from __future__ import annotations

from pipeserve.events import Event
from pipeserve.stages.toolfmt.base import CallSink, MarkerParser, content
from pipeserve.stages.toolfmt.call_array import CallArray
from pipeserve.stages.toolfmt.markers import MarkerSet


class ArrayFormat(MarkerParser):
    def __init__(self, sink: CallSink, start: str, end: str = "") -> None:
        super().__init__()
        self.sink = sink
        self.start, self.end = start, end
        self._set = MarkerSet([start, end])
        self.calls: CallArray | None = None
        self.closable = False  # the end marker would close the calls just parsed

    def _markers(self) -> MarkerSet:
        return self._set

    def _text(self, text: str, out: list[Event]) -> None:
        if self.calls is None:
            if text.strip():
                self.closable = False
            content(text, out)
            return
        rest = self.calls.feed(text, out)
        if self.calls.done:
            self.closable = not self.calls.failed
            self.calls = None
            if rest:
                self._text(rest, out)

    def _marker(self, marker: str, out: list[Event]) -> None:
        if marker == self.start:
            self._close(out, cut=False)
            self.calls = CallArray(self.sink, marker)
            return
        if self.calls is not None:  # the end marker closes the calls
            self._close(out, cut=False)
        elif not self.closable:
            content(marker, out)
        self.closable = False

    def _close(self, out: list[Event], cut: bool) -> None:
        if self.calls is not None:
            self.calls.end(out, cut)
            self.closable = not self.calls.failed
            self.calls = None

    def finish(self, reason: str, out: list[Event]) -> None:
        self.flush(out)
        self._close(out, cut=True)
