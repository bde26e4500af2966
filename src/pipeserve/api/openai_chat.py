"""OpenAI Chat Completions (`/v1/chat/completions`): the request decoder and the protocol.

Events and their fold live in openai_chat_encode. Unknown body fields are accepted and
ignored; malformed known fields are a 400 naming the field (`messages[2].content[0].text`),
and so are known fields we cannot honour when ignoring them would silently change the answer
(n > 1, JSON response formats, audio, the legacy functions API). `logit_bias` is applied
with this model's token ids (as other open-model servers do; ids outside its vocabulary
are a 400).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from pipeserve.api.base import RequestMeta, WireProtocol, register_protocol
from pipeserve.api.framing import json_frames, sse_frames
from pipeserve.api.openai_chat_encode import ChatEvents, fold_completion
from pipeserve.api.openai_common import (
    Lenient,
    check,
    check_tool_choice,
    close_events,
    openai_error_body,
    reasoning_options,
    seed_value,
    text_of_parts,
    tool_choice_mode,
    unsupported,
    validate,
)
from pipeserve.api.structured import openai_output_format
from pipeserve.api.template_kwargs import decode_template_kwargs
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError, invalid
from pipeserve.events import Event
from pipeserve.request import (
    GenerationRequest,
    Message,
    SamplingParams,
    ToolCall,
    ToolChoice,
    ToolSpec,
    sampling_params,
)

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
    reasoning: Any = None  # the newer vLLM / OpenRouter spelling (a string when used that way)


class StreamOptions(Lenient):
    include_usage: bool | None = None


class OpenAISamplingIn(Lenient):
    """The sampling fields Chat and legacy Completions share; left out, the model's
    sampling defaults apply (YAML / generation_config.json)."""

    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = None
    logit_bias: Any = None  # checked by logit_bias_of

    def sampling(self) -> SamplingParams:
        return sampling_params(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=None if self.top_k is None else max(self.top_k, 0),
            min_p=self.min_p,
            repetition_penalty=None
            if self.repetition_penalty is None
            else self.repetition_penalty or 1.0,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=logit_bias_of(self.logit_bias),
            seed=seed_value(self.seed),
        )


class ChatRequestIn(OpenAISamplingIn):
    model: str
    messages: list[MessageIn] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    stop: Any = None
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
    chat_template_kwargs: Any = None  # checked by api/template_kwargs
    # Known fields this server cannot honour: refused when set to anything but a no-op
    # (see _refuse_unhonoured). Other known fields -- user, metadata, store, service_tier,
    # prediction, verbosity, prompt_cache_key, safety_identifier, web_search_options --
    # only affect billing, storage, latency or hosted tools and are accepted and ignored.
    response_format: Any = None
    modalities: Any = None
    audio: Any = None
    functions: Any = None
    function_call: Any = None


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
        reasoning = raw.reasoning_content
        if reasoning is None and isinstance(raw.reasoning, str):
            reasoning = raw.reasoning
        return Message("assistant", content, reasoning, calls)
    check(raw.content is not None, f"{path}.content")
    content = text_of_parts(raw.content, f"{path}.content", TEXT_PARTS, IMAGE_PARTS)
    if role in ("system", "developer", "user"):
        return Message("system" if role == "developer" else role, content)
    if role == "function":  # legacy function result: no call id
        return Message("tool", content, name=raw.name)
    call_id = raw.tool_call_id
    check(call_id is not None, f"{path}.tool_call_id")
    name = raw.name or call_names.get(call_id or "")
    return Message("tool", content, tool_call_id=call_id, name=name)


def _tools(raw: list[dict[str, Any]] | None) -> list[ToolSpec]:
    specs: list[ToolSpec] = []
    for i, tool in enumerate(raw or []):
        path = f"tools[{i}]"
        check(isinstance(tool, dict), path, "expected an object")
        if tool.get("type", "function") != "function":
            continue  # custom / hosted tool types: skipped, not an error
        fn: Any = tool.get("function")
        check(isinstance(fn, dict), f"{path}.function")
        name, params = fn.get("name"), fn.get("parameters")
        check(isinstance(name, str) and name != "", f"{path}.function.name")
        check(
            params is None or isinstance(params, dict),
            f"{path}.function.parameters",
            "expected an object",
        )
        spec = ToolSpec(name, str(fn.get("description") or ""), strict=fn.get("strict") is True)
        if params:
            spec.parameters = params
        specs.append(spec)
    return specs


def _tool_choice(raw: Any) -> ToolChoice:
    if (mode := tool_choice_mode(raw)) is not None:
        return mode
    kind = raw.get("type", "function")
    if kind == "allowed_tools":
        allowed = raw.get("allowed_tools")
        check(isinstance(allowed, dict), "tool_choice.allowed_tools")
        mode = allowed.get("mode")
        check(
            mode in ("auto", "required"),
            "tool_choice.allowed_tools.mode",
            f"{mode!r} is not one of auto, required",
        )
        return ToolChoice(mode)
    if kind != "function":
        raise unsupported(
            "tool_choice", f"forcing a {kind!r} tool (only function tools are served)"
        )
    fn = raw.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    check(isinstance(name, str), "tool_choice.function.name")
    return ToolChoice("function", name)


def _allowed(raw: Any, tools: list[ToolSpec]) -> list[ToolSpec]:
    """tool_choice allowed_tools: only the listed function tools may be called."""
    if not isinstance(raw, dict) or raw.get("type") != "allowed_tools":
        return tools
    listed = raw["allowed_tools"].get("tools")
    check(isinstance(listed, list), "tool_choice.allowed_tools.tools")
    names = set()
    for i, entry in enumerate(listed):
        where = f"tool_choice.allowed_tools.tools[{i}]"
        check(isinstance(entry, dict), where, "expected an object")
        if entry.get("type", "function") == "function":
            fn = entry.get("function")
            check(
                isinstance(fn, dict) and isinstance(fn.get("name"), str), f"{where}.function.name"
            )
            names.add(fn["name"])
    return [tool for tool in tools if tool.name in names]


def stop_of(raw: Any) -> list[str]:
    if raw is None:
        return []
    values = [raw] if isinstance(raw, str) else raw
    valid = isinstance(values, list) and all(isinstance(s, str) for s in values)
    check(valid, "stop", "expected a string or an array of strings")
    return [s for s in values if s]


def logit_bias_of(raw: Any) -> dict[int, float]:
    """`{"token id": bias}` in this model's vocabulary (ids are checked against it later)."""
    if raw is None:
        return {}
    check(isinstance(raw, dict), "logit_bias", "expected an object mapping token ids to biases")
    bias: dict[int, float] = {}
    for key, value in raw.items():
        check(isinstance(key, str) and key.isdigit(), "logit_bias", f"{key!r} is not a token id")
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        check(
            number and -100 <= value <= 100,
            "logit_bias",
            f"the bias of {key} must be a number in [-100, 100]",
        )
        bias[int(key)] = float(value)
    return bias


def _refuse_unhonoured(req: ChatRequestIn) -> None:
    """Parameters whose silent omission would give a wrong answer are a 400 naming them."""
    if req.modalities is not None:
        check(isinstance(req.modalities, list), "modalities", "expected an array")
        if any(m != "text" for m in req.modalities):
            raise unsupported("modalities", "only 'text' output is available")
    if req.audio is not None:
        raise unsupported("audio", "audio output is not available")
    if req.functions:
        raise unsupported("functions", "the deprecated functions API is not served; use 'tools'")
    if isinstance(req.function_call, dict):
        raise unsupported(
            "function_call", "the deprecated functions API is not served; use 'tool_choice'"
        )


def decode_chat(body: Any) -> ChatGenerationRequest:
    req = validate(ChatRequestIn, body)
    if req.n is not None and req.n != 1:
        raise invalid("Only n=1 is supported.", "n")
    _refuse_unhonoured(req)
    if req.top_logprobs and not req.logprobs:
        raise invalid("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")
    call_names: dict[str, str] = {}
    messages = [_message(m, f"messages[{i}]", call_names) for i, m in enumerate(req.messages)]
    choice = _tool_choice(req.tool_choice)
    tools = _allowed(req.tool_choice, _tools(req.tools))
    check_tool_choice(choice, tools, "tool_choice")
    sampling = req.sampling()
    template_kwargs, reasoning = decode_template_kwargs(
        req.chat_template_kwargs, reasoning_options(req.reasoning_effort, "reasoning_effort")
    )
    return ChatGenerationRequest(
        model=req.model,
        messages=messages,
        tools=tools,
        tool_choice=choice,
        sampling=sampling,
        max_tokens=req.max_completion_tokens or req.max_tokens,
        stop=stop_of(req.stop),
        stream=bool(req.stream),
        reasoning=reasoning,
        template_kwargs=template_kwargs,
        logprobs=bool(req.logprobs),
        top_logprobs=req.top_logprobs or 0,
        mock_response=req.mock_response,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        output_format=openai_output_format(req.response_format, "response_format", flat=False),
    )


@register_protocol
class OpenAIChat(WireProtocol):
    name = "openai-chat"

    def decode(self, body: Any, meta: RequestMeta) -> GenerationRequest:
        return decode_chat(body)

    def encode_json(self, events: Iterator[Event], ctx: RequestContext) -> dict[str, Any]:
        try:
            chunks = json_frames(ChatEvents(ctx, include_usage=True), events, ctx)
            return fold_completion(chunks, ctx)
        finally:
            close_events(events)

    def encode_stream(self, events: Iterator[Event], ctx: RequestContext) -> Iterator[bytes]:
        request = ctx.request
        usage = isinstance(request, ChatGenerationRequest) and request.include_usage
        try:
            yield from sse_frames(ChatEvents(ctx, include_usage=usage), events, ctx)
        finally:
            close_events(events)

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return openai_error_body(error)


__all__ = ["ChatGenerationRequest", "OpenAIChat", "decode_chat"]
