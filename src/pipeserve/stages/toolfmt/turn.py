"""Turn-level shaping of the tool_calls stage output (applies to every format).

Whitespace: a model separates and ends its calls with newlines ("</tool_call>\\n<tool_call>",
"</think>\\n\\n<tool_call>"). Whitespace-only text at a boundary (start of the answer,
after reasoning, after a call) is held; it is dropped when a call, reasoning or the end
of a turn with calls follows, and released in front of the next real text. A turn
without calls keeps its text exactly.

Valid calls: a call counts for the finish reason "tool_calls" only when it ended with
arguments that are a JSON object. A call cut off by max tokens keeps "length"; a turn
whose only calls are malformed finishes "stop", so no client runs a tool on input the
model never completed (the encoders mark such calls, see each encoder's docstring).
"""

from __future__ import annotations

from pipeserve.events import (
    ContentDelta,
    Event,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    arguments_valid,
)

_TURN_OUTPUT = (ContentDelta, ReasoningDelta, ToolCallStart, ToolCallArgsDelta, ToolCallEnd)


class TurnShaper:
    """Filters one request's events in order; per-request state, O(1) per event."""

    def __init__(self, single: bool = False) -> None:
        self.single = single
        self.closed = False  # single mode: the one call is complete
        self.held: list[str] = []
        self.at_boundary = True
        self.calls = 0
        self.valid = 0  # calls that ended with a JSON object as arguments

    def push(self, event: Event, out: list[Event]) -> None:
        kind = type(event)
        if self.closed and kind in _TURN_OUTPUT:
            return
        if kind is ContentDelta:
            self._content(event.text, out)  # type: ignore[union-attr]
            return
        if kind is ToolCallStart or kind is ReasoningDelta:
            self.held.clear()
            self.at_boundary = True
            self.calls += kind is ToolCallStart
        elif kind is ToolCallEnd:
            self.at_boundary = True
            if arguments_valid(event.arguments):  # type: ignore[union-attr]
                self.valid += 1
                self.closed = self.single
        out.append(event)

    def end(self, out: list[Event]) -> None:
        """The turn ended: held whitespace is kept only in an answer without calls."""
        if self.held and not self.calls:
            out.append(ContentDelta("".join(self.held)))
        self.held.clear()

    def _content(self, text: str, out: list[Event]) -> None:
        if self.at_boundary and not text.strip():
            if text:
                self.held.append(text)
            return
        if self.held:
            text = "".join(self.held) + text
            self.held.clear()
        self.at_boundary = False
        out.append(ContentDelta(text))
