"""OpenAI Chat Completions (`/v1/chat/completions`): request decoder and encoders."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field

from pipeserve.api.base import RequestMeta, WireProtocol, register_protocol
from pipeserve.api.openai_common import (
    KEEPALIVE_FRAME,
    Lenient,
    LogprobCursor,
    api_error_from_event,
    cancelled_error,
    chat_usage,
    check_tool_choice,
    new_id,
    now,
    openai_error_body,
    reasoning_options,
    require,
    text_of_parts,
    validate,
)
from pipeserve.api.sse import sse_event
from pipeserve.errors import ApiError, invalid
from pipeserve.events import (
    ContentDelta,
    ErrorEvent,
    Event,
    Finish,
    KeepAlive,
    ReasoningDelta,
    TokenText,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from pipeserve.request import (
    GenerationRequest,
    Message,
    SamplingParams,
    ToolCall,
    ToolChoice,
    ToolSpec,
)
from pipeserve.stages.base import RequestContext

TEXT_PARTS = frozenset({"text", "input_text"})
IMAGE_PARTS = frozenset({"image_url", "input_image", "input_audio", "file", "image"})


class FunctionCallIn(Lenient):
    name: str
    arguments: Any = ""


class ToolCallIn(Lenient):
    id: str
    type: str = "function"
    function: FunctionCallIn


class MessageIn(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Any = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class StreamOptions(Lenient):
    include_usage: bool | None = None


class ChatRequestIn(Lenient):
    model: str
    messages: list[MessageIn] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    stop: Any = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    reasoning_effort: str | None = None
    parallel_tool_calls: bool | None = None
    mock_response: str | None = None


@dataclass(slots=True)
class ChatGenerationRequest(GenerationRequest):
    """GenerationRequest plus the Chat-only facts its encoder needs."""

    include_usage: bool = False


# ---------------------------------------------------------------- decode


def _arguments(value: Any) -> str:
    if isinstance(value, str):
        return value
    return "{}" if value is None else json.dumps(value, ensure_ascii=False)


def _message(raw: MessageIn, path: str, call_names: dict[str, str]) -> Message:
    role = raw.role
    if role == "assistant":
        calls = [
            ToolCall(c.id, c.function.name, _arguments(c.function.arguments))
            for c in raw.tool_calls or []
        ]
        call_names.update((c.id, c.name) for c in calls)
        content = text_of_parts(raw.content, f"{path}.content", TEXT_PARTS, IMAGE_PARTS)
        return Message("assistant", content, raw.reasoning_content, calls)
    require(raw.content is not None, f"Missing required parameter: '{path}.content'.", f"{path}.content")
    content = text_of_parts(raw.content, f"{path}.content", TEXT_PARTS, IMAGE_PARTS)
    if role in ("system", "developer", "user"):
        return Message("system" if role == "developer" else role, content)
    if role == "function":  # legacy function result: no call id
        return Message("tool", content, name=raw.name)
    where = f"{path}.tool_call_id"
    require(raw.tool_call_id is not None, f"Missing required parameter: '{where}'.", where)
    assert raw.tool_call_id is not None
    name = raw.name or call_names.get(raw.tool_call_id)
    return Message("tool", content, tool_call_id=raw.tool_call_id, name=name)


def _tools(raw: list[dict[str, Any]] | None) -> list[ToolSpec]:
    specs: list[ToolSpec] = []
    for i, tool in enumerate(raw or []):
        path = f"tools[{i}]"
        require(isinstance(tool, dict), f"'{path}' must be an object.", path)
        if tool.get("type", "function") != "function":
            continue  # custom / hosted tool types: skipped, not an error
        fn = tool.get("function")
        require(isinstance(fn, dict), f"Missing required parameter: '{path}.function'.", f"{path}.function")
        name, params = fn.get("name"), fn.get("parameters")
        require(isinstance(name, str) and name != "", f"Invalid value for '{path}.function.name'.", f"{path}.function.name")
        require(params is None or isinstance(params, dict), f"Invalid type for '{path}.function.parameters': expected an object.", f"{path}.function.parameters")
        spec = ToolSpec(name, str(fn.get("description") or ""))
        if params:
            spec.parameters = params
        specs.append(spec)
    return specs


def _tool_choice(raw: Any) -> ToolChoice:
    if raw is None:
        return ToolChoice()
    if isinstance(raw, str):
        require(raw in ("auto", "none", "required"), f"Invalid value for 'tool_choice': {raw!r}.", "tool_choice")
        return ToolChoice(raw)  # type: ignore[arg-type]
    require(isinstance(raw, dict), "Invalid type for 'tool_choice'.", "tool_choice")
    fn = raw.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    require(isinstance(name, str), "Missing required parameter: 'tool_choice.function.name'.", "tool_choice.function.name")
    return ToolChoice("function", name)


def _stop(raw: Any) -> list[str]:
    if raw is None:
        return []
    values = [raw] if isinstance(raw, str) else raw
    require(isinstance(values, list) and all(isinstance(s, str) for s in values), "Invalid type for 'stop': expected a string or an array of strings.", "stop")
    return [s for s in values if s]


def decode_chat(body: Any) -> ChatGenerationRequest:
    req = validate(ChatRequestIn, body)
    if req.n is not None and req.n != 1:
        raise invalid("Only n=1 is supported.", "n")
    if req.top_logprobs and not req.logprobs:
        raise invalid("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")
    call_names: dict[str, str] = {}
    messages = [_message(m, f"messages[{i}]", call_names) for i, m in enumerate(req.messages)]
    tools = _tools(req.tools)
    choice = _tool_choice(req.tool_choice)
    check_tool_choice(choice, tools, "tool_choice")
    sampling = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(req.top_k or 0, 0),
        min_p=req.min_p or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0,
        seed=req.seed,
    )
    return ChatGenerationRequest(
        model=req.model,
        messages=messages,
        tools=tools,
        tool_choice=choice,
        sampling=sampling,
        max_tokens=req.max_completion_tokens or req.max_tokens,
        stop=_stop(req.stop),
        stream=bool(req.stream),
        reasoning=reasoning_options(req.reasoning_effort, "reasoning_effort"),
        logprobs=bool(req.logprobs),
        top_logprobs=req.top_logprobs or 0,
        mock_response=req.mock_response,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
    )


# ---------------------------------------------------------------- encode


FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls"}


@dataclass
class _Call:
    id: str
    name: str
    streamed: str = ""
    arguments: str | None = None


@dataclass
class _Accumulated:
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, _Call] = field(default_factory=dict)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish: str = "stop"
    usage: Usage = field(default_factory=lambda: Usage(0, 0))


def _finish_reason(event: Finish, has_calls: bool, ctx: RequestContext) -> str:
    if event.reason == "cancelled":
        raise cancelled_error(ctx)
    if event.reason == "error":
        raise ApiError("internal", "generation failed")
    if event.reason == "stop" and has_calls:
        return "tool_calls"
    return FINISH[event.reason]


def _close(events: Iterator[Event]) -> None:
    close = getattr(events, "close", None)
    if close is not None:
        close()


def _accumulate(events: Iterator[Event], ctx: RequestContext) -> _Accumulated:
    acc, cursor = _Accumulated(), LogprobCursor(ctx)
    for event in events:
        if isinstance(event, (ContentDelta, TokenText)):
            acc.content.append(event.text)
            acc.logprobs += cursor.take(event if isinstance(event, TokenText) else None)
        elif isinstance(event, ReasoningDelta):
            acc.reasoning.append(event.text)
            cursor.skip()
        elif isinstance(event, ToolCallStart):
            acc.calls[event.index] = _Call(event.id or new_id("call_"), event.name)
            cursor.skip()
        elif isinstance(event, ToolCallArgsDelta) and event.index in acc.calls:
            acc.calls[event.index].streamed += event.fragment
        elif isinstance(event, ToolCallEnd) and event.index in acc.calls:
            acc.calls[event.index].arguments = event.arguments
        elif isinstance(event, Finish):
            acc.finish = _finish_reason(event, bool(acc.calls), ctx)
        elif isinstance(event, Usage):
            acc.usage = event
        elif isinstance(event, ErrorEvent):
            raise api_error_from_event(event)
    return acc


class ChatStreamEncoder:
    """Turns events into `chat.completion.chunk` SSE frames (one instance per request)."""

    def __init__(self, ctx: RequestContext) -> None:
        self.ctx = ctx
        self.id = new_id("chatcmpl-")
        self.created = now()
        self.include_usage = bool(getattr(ctx.request, "include_usage", False))
        self.cursor = LogprobCursor(ctx)
        self.calls: dict[int, _Call] = {}
        self.usage = Usage(0, 0)

    def chunk(self, delta: dict[str, Any], finish: str | None = None, logprobs: list[dict[str, Any]] | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if logprobs:
            choice["logprobs"] = {"content": logprobs, "refusal": None}
        return sse_event(self._base([choice]))

    def _base(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.ctx.model_name, "choices": choices}
        if self.include_usage:
            body["usage"] = None
        return body

    def error(self, err: ApiError) -> bytes:
        return sse_event(openai_error_body(err))

    def run(self, events: Iterator[Event]) -> Iterator[bytes]:
        yield self.chunk({"role": "assistant", "content": ""})
        for event in events:
            try:
                frame = self.frame(event)
            except ApiError as err:
                yield self.error(err)
                return
            if frame:
                yield frame
        if self.include_usage:
            yield sse_event({**self._base([]), "usage": chat_usage(self.usage)})
        yield sse_event("[DONE]")

    def frame(self, event: Event) -> bytes | None:
        if isinstance(event, (ContentDelta, TokenText)):
            direct = event if isinstance(event, TokenText) else None
            logprobs = self.cursor.take(direct)
            return self.chunk({"content": event.text}, logprobs=logprobs) if event.text else None
        if isinstance(event, ReasoningDelta):
            self.cursor.skip()
            return self.chunk({"reasoning_content": event.text}) if event.text else None
        if isinstance(event, (ToolCallStart, ToolCallArgsDelta, ToolCallEnd)):
            return self.tool_frame(event)
        if isinstance(event, Finish):
            return self.chunk({}, _finish_reason(event, bool(self.calls), self.ctx))
        if isinstance(event, Usage):
            self.usage = event
        elif isinstance(event, ErrorEvent):
            raise api_error_from_event(event)
        elif isinstance(event, KeepAlive):
            return KEEPALIVE_FRAME
        return None

    def tool_frame(self, event: ToolCallStart | ToolCallArgsDelta | ToolCallEnd) -> bytes | None:
        if isinstance(event, ToolCallStart):
            self.cursor.skip()
            call = self.calls[event.index] = _Call(event.id or new_id("call_"), event.name)
            fn = {"name": call.name, "arguments": ""}
            return self.chunk({"tool_calls": [{"index": event.index, "id": call.id, "type": "function", "function": fn}]})
        existing = self.calls.get(event.index)
        if existing is None:
            return None
        if isinstance(event, ToolCallArgsDelta):
            fragment = event.fragment
        elif event.arguments.startswith(existing.streamed):
            fragment = event.arguments[len(existing.streamed) :]  # text never streamed
        else:
            return None  # coerced arguments differ from the streamed ones: cannot retract
        existing.streamed += fragment
        if not fragment:
            return None
        return self.chunk({"tool_calls": [{"index": event.index, "function": {"arguments": fragment}}]})


@register_protocol
class OpenAIChat(WireProtocol):
    name = "openai-chat"

    def decode(self, body: Any, meta: RequestMeta) -> GenerationRequest:
        return decode_chat(body)

    def encode_json(self, events: Iterator[Event], ctx: RequestContext) -> dict[str, Any]:
        try:
            acc = _accumulate(events, ctx)
        finally:
            _close(events)
        return completion_body(acc, ctx)

    def encode_stream(self, events: Iterator[Event], ctx: RequestContext) -> Iterator[bytes]:
        try:
            yield from ChatStreamEncoder(ctx).run(events)
        finally:
            _close(events)

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return openai_error_body(error)


def completion_body(acc: _Accumulated, ctx: RequestContext) -> dict[str, Any]:
    content = "".join(acc.content)
    calls = [acc.calls[i] for i in sorted(acc.calls)]
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if calls:
        message["content"] = content if content.strip() else None
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.streamed if c.arguments is None else c.arguments}}
            for c in calls
        ]
    if acc.reasoning:
        message["reasoning_content"] = "".join(acc.reasoning)
    logprobs = {"content": acc.logprobs, "refusal": None} if ctx.request.logprobs else None
    return {
        "id": new_id("chatcmpl-"),
        "object": "chat.completion",
        "created": now(),
        "model": ctx.model_name,
        "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": acc.finish}],
        "usage": chat_usage(acc.usage),
    }


__all__ = ["ChatGenerationRequest", "OpenAIChat", "decode_chat"]
