"""GPT-OSS Harmony output, parsed token by token with openai-harmony's StreamableParser.

Each message's header decides where its body goes: a recipient (`to=functions.NAME`)
makes it a tool call whose body streams as JSON arguments; a reasoning channel
(`analysis`) goes to reasoning; anything else (`final`, `commentary` preambles) is
content. Tokens the parser rejects (a model that does not speak Harmony) are delivered
as content and parsing resumes at the next `<|start|>`.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Literal

from pydantic import Field

from pipeserve.constraint import Envelope
from pipeserve.events import ContentDelta, Event, ReasoningDelta, TokenText
from pipeserve.stages.toolfmt.base import CallSink, StreamedArgs, ToolFormat, content
from pipeserve.stages.toolfmt.registry import (
    CallFrame,
    CallsLayout,
    ToolFormatParams,
    register_tool_format,
)

_MAX_HEADER_TOKENS = 64  # a header that long is not a header: deliver it as text
_ENDS = ("<|end|>", "<|call|>", "<|return|>")


@functools.lru_cache(maxsize=1)
def load_encoding() -> Any:
    """The GPT-OSS Harmony encoding (needs o200k_base.tiktoken; written offline if absent)."""
    if not os.environ.get("TIKTOKEN_ENCODINGS_BASE"):
        from pipeserve.engine.weights.demo.build import ensure_tiktoken_base

        ensure_tiktoken_base()
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


class HarmonyFormat:
    def __init__(
        self, encoding: Any, sink: CallSink, reasoning_channels: frozenset[str], calls_enabled: bool
    ) -> None:
        from openai_harmony import HarmonyError, Role, StreamableParser

        self.encoding = encoding
        self._parser_class: Any = StreamableParser
        self._error = HarmonyError
        self.parser = self._new_parser(Role.ASSISTANT)
        special = {t: encoding.encode(t, allowed_special="all")[0] for t in ("<|message|>", *_ENDS)}
        self._message_id = special["<|message|>"]
        self._end_ids = frozenset(special[t] for t in _ENDS)
        self.sink = sink
        self.reasoning_channels = reasoning_channels
        self.calls_enabled = calls_enabled
        self.kind: str | None = None  # None while in a header; reasoning | content | call
        self.header: list[str] = []
        self.call: StreamedArgs | None = None
        self.reasoning_tokens: int | None = 0

    def _new_parser(self, role: Any) -> Any:
        return self._parser_class(self.encoding, role, strict=False)

    def prefill(self, text: str, out: list[Event]) -> None:
        """Feed the forced assistant prefix (tool_choice) as if the model had written it."""
        for token_id in self.encoding.encode(text, allowed_special="all"):
            self.feed_token(TokenText(self.encoding.decode([token_id]), token_id), out)

    def feed_token(self, token: TokenText, out: list[Event]) -> None:
        try:
            self.parser.process(token.token_id)
        except self._error:
            self._degrade(token.text, out)
            return
        if self.kind is None:
            if token.token_id == self._message_id:
                self._open(out)
            else:
                self.header.append(token.text)
                if len(self.header) > _MAX_HEADER_TOKENS:
                    self._degrade("", out)
            return
        if token.token_id in self._end_ids:
            self._close(out)
            return
        delta = self.parser.last_content_delta
        if self.kind == "reasoning":
            assert self.reasoning_tokens is not None
            self.reasoning_tokens += 1
            if delta:
                out.append(ReasoningDelta(delta))
        elif self.kind == "call":
            assert self.call is not None
            if delta:
                self.call.feed(delta, out)
        elif delta:
            out.append(ContentDelta(delta))

    def finish(self, reason: str, out: list[Event]) -> None:
        if self.kind == "call" and reason == "stop":  # the stop token was <|call|>
            self._eos()
            self._close(out)
        elif self.kind == "call":
            assert self.call is not None
            self.call.cut(out)
        elif self.kind is not None:
            self._eos()
        elif self.header and not any(t.startswith("<|") for t in self.header):
            content("".join(self.header), out)  # plain text that never became a message
        self.kind, self.call, self.header = None, None, []

    def _eos(self) -> None:
        try:
            self.parser.process_eos()
        except self._error:
            pass

    def _open(self, out: list[Event]) -> None:
        self.header = []
        recipient = self.parser.current_recipient
        channel = self.parser.current_channel
        if recipient and self.calls_enabled:
            self.kind = "call"
            name = recipient.removeprefix("functions.")
            self.call = StreamedArgs(self.sink, name, out)
        elif channel in self.reasoning_channels:
            self.kind = "reasoning"
        else:
            self.kind = "content"

    def _close(self, out: list[Event]) -> None:
        if self.call is not None:
            self.call.end(out)
        self.kind, self.call = None, None

    def _degrade(self, text: str, out: list[Event]) -> None:
        """The parser rejected a token: deliver the text and wait for the next <|start|>."""
        if self.call is not None:
            self.call.cut(out)
        content("".join(self.header) + text, out)
        self.kind, self.call, self.header = None, None, []
        self.parser = self._new_parser(None)


class HarmonyParams(ToolFormatParams):
    format: Literal["harmony"]
    reasoning_channels: list[str] = Field(
        ["analysis"], description="Channels whose messages are reasoning."
    )
    prefill_required: str = Field(
        "<|channel|>commentary to=functions.", description="Prompt suffix forcing some call."
    )
    prefill_function: str = Field(
        "<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>",
        description="Prompt suffix forcing a call to {name}.",
    )

    def call_frame(self, name: str) -> CallFrame:
        return CallFrame(self.forced_prefill(name), "<|call|>")

    def calls_layout(self) -> CallsLayout:
        """A call is a commentary message instead of the final answer; `<|call|>` ends
        the turn."""
        return CallsLayout("", after_text=False, single=True)

    def envelope(self) -> Envelope:
        """Reasoning messages on the first reasoning channel, the answer in `final`."""
        channel = self.reasoning_channels[0] if self.reasoning_channels else "analysis"
        return Envelope(
            reasoning_open=f"<|channel|>{channel}<|message|>",
            reasoning_close="<|end|><|start|>assistant",
            answer_open="<|channel|>final<|message|>",
            answer_close="<|return|>",
            repeat=True,
        )


@register_tool_format("harmony", HarmonyParams, parses_without_calls=True, warm_up=load_encoding)
def harmony_parser(params: HarmonyParams, sink: CallSink, calls_enabled: bool) -> ToolFormat:
    """GPT-OSS Harmony: channels and `to=functions.NAME` recipients, token by token."""
    return HarmonyFormat(load_encoding(), sink, frozenset(params.reasoning_channels), calls_enabled)
