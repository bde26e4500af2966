"""Shared pieces of the tool-call formats: call numbering, streamed arguments, and the
marker-driven text parser loop the json, glm and kimi formats are built on."""

from __future__ import annotations

import json
import secrets
from typing import Any, Protocol

from pipeserve.events import (
    ContentDelta,
    Event,
    TokenText,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from pipeserve.request import ToolSpec
from pipeserve.stages.toolfmt.coerce import coerce, dumps
from pipeserve.stages.toolfmt.json_stream import JsonStreamer
from pipeserve.stages.toolfmt.markers import MarkerSet, Splitter


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class CallSink:
    """Numbers the calls of one response and knows each tool's parameter schema."""

    def __init__(self, tools: list[ToolSpec]) -> None:
        self._schemas = {tool.name: tool.parameters for tool in tools}
        self.count = 0

    def schema(self, name: str) -> Any:
        return self._schemas.get(name)

    def has(self, name: str) -> bool:
        """The request offers a tool of this name."""
        return name in self._schemas

    def start(self, name: str, out: list[Event]) -> int:
        index = self.count
        self.count += 1
        out.append(ToolCallStart(index, new_call_id(), name))
        return index

    def whole(self, name: str, arguments: Any, out: list[Event]) -> None:
        """A call parsed in one piece: start, one fragment, end."""
        index = self.start(name, out)
        text = dumps(coerce(arguments, self.schema(name)))
        out.append(ToolCallArgsDelta(index, text))
        out.append(ToolCallEnd(index, text))


class StreamedArgs:
    """One call whose JSON arguments stream as fragments; fragments join to the result."""

    def __init__(self, sink: CallSink, name: str, out: list[Event]) -> None:
        self.index = sink.start(name, out)
        self.streamer = JsonStreamer(sink.schema(name))
        self._parts: list[str] = []

    @property
    def done(self) -> bool:
        return self.streamer.done

    def feed(self, text: str, out: list[Event]) -> str:
        """Stream `text`; returns what follows the arguments once they are complete."""
        fragment, rest = self.streamer.feed(text)
        self._emit(fragment, out)
        return rest

    def end(self, out: list[Event], fix_raw: Any = None) -> None:
        """The call's end marker arrived: repair what is missing and close the call."""
        if self.streamer.failed:
            raw = self.streamer.raw_tail()
            self._emit(fix_raw(raw) if fix_raw else raw, out)
        else:
            self._emit(self.streamer.close(), out)
        out.append(ToolCallEnd(self.index, "".join(self._parts)))

    def cut(self, out: list[Event]) -> None:
        """Generation stopped inside the call: deliver everything written, unrepaired."""
        if not self.streamer.done:
            self._emit(self.streamer.raw_tail(), out)
        out.append(ToolCallEnd(self.index, "".join(self._parts)))

    def _emit(self, fragment: str, out: list[Event]) -> None:
        if fragment:
            self._parts.append(fragment)
            out.append(ToolCallArgsDelta(self.index, fragment))


class ToolFormat(Protocol):
    """A per-request parser; `reasoning_tokens` is None unless the format sees reasoning."""

    reasoning_tokens: int | None

    def prefill(self, text: str, out: list[Event]) -> None:
        """Parse the forced assistant prefix (tool_choice) as if the model had written it."""

    def feed_token(self, token: TokenText, out: list[Event]) -> None: ...

    def finish(self, reason: str, out: list[Event]) -> None: ...


class MarkerParser:
    """Text format base: splits text at the state's markers and dispatches the parts."""

    reasoning_tokens: int | None = None

    def __init__(self) -> None:
        self._splitter = Splitter()

    def prefill(self, text: str, out: list[Event]) -> None:
        self.feed(text, out)

    def feed_token(self, token: TokenText, out: list[Event]) -> None:
        if token.text:
            self.feed(token.text, out)

    def feed(self, text: str, out: list[Event]) -> None:
        buf = self._splitter.take(text)
        while buf:
            markers = self._markers()
            before, marker, after = self._splitter.split(buf, markers)
            if before:
                self._text(before, out)
                if marker is not None and self._markers() is not markers:
                    buf = marker + after  # the text changed the state: split again
                    continue
            if marker is None:
                self._splitter.held = after
                return
            self._marker(marker, out)
            buf = after

    def flush(self, out: list[Event]) -> None:
        held = self._splitter.flush()
        if held:
            self._text(held, out)

    def _markers(self) -> MarkerSet:
        raise NotImplementedError

    def _text(self, text: str, out: list[Event]) -> None:
        raise NotImplementedError

    def _marker(self, marker: str, out: list[Event]) -> None:
        raise NotImplementedError


def content(text: str, out: list[Event]) -> None:
    if text:
        out.append(ContentDelta(text))


def parse_json_calls(body: str) -> list[tuple[str, Any]] | None:
    """`{"name": .., "arguments": ..}` (or a list of them) in one piece; None if not that."""
    try:
        value = json.loads(body.strip(), strict=False)
    except ValueError:
        return None
    calls = [json_call(item) for item in (value if isinstance(value, list) else [value])]
    if not calls or any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None]


def json_call(item: Any) -> tuple[str, Any] | None:
    """(name, arguments) of one parsed `{"name": .., "arguments" | "parameters": ..}`
    object (arguments may be a JSON string), else None."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments, strict=False)
        except ValueError:
            return None
    return item["name"], {} if arguments is None else arguments
