"""OpenAI Responses (`/v1/responses`): request decoder and encoders.

With the response store (openai_responses_state.py), `previous_response_id` and
`item_reference` inputs are resolved and responses are stored; without it they are
refused (400 naming them) and clients resend the history (as Codex does). `conversation`
and `prompt` are always refused. Output items are built strictly one after another; the
JSON encoder runs the same item builder as the stream and returns its final response object.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import Field

from pipeserve.api.base import RequestMeta, WireProtocol, register_protocol
from pipeserve.api.framing import EventEncoder, Frame, json_frames, sse_frames
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
from pipeserve.api.openai_responses_encode import ResponsesBuilder, open_reasoning
from pipeserve.api.openai_responses_state import ResolvedInput, ResponsesState
from pipeserve.api.structured import openai_output_format
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError, invalid
from pipeserve.events import Event
from pipeserve.request import (
    GenerationRequest,
    Message,
    ToolCall,
    ToolChoice,
    ToolSpec,
    sampling_params,
)
from pipeserve.store import ResponseStore

TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text"})
IMAGE_PARTS = frozenset({"input_image", "input_file", "input_audio", "image_url"})
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# `include` asks for extra output. Ours are logprobs and reasoning.encrypted_content; other
# values (hosted tools, input images, and any an agent CLI adds later) add nothing here and
# are ignored, so a newer client is not refused for asking for more.


class ReasoningIn(Lenient):
    effort: str | None = None
    # any of them: the reasoning text is sent as the item's summary (we do not shorten it)
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequestIn(Lenient):
    model: str
    input: Any = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    stream: bool | None = None
    reasoning: ReasoningIn | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, Any] | None = None
    mock_response: str | None = None
    prompt: Any = None  # a stored prompt template: cannot be resolved here, refused
    truncation: Literal["auto", "disabled"] | None = None
    # Echoed, otherwise no effect: they apply to built-in tools, storage, caching or billing.
    max_tool_calls: int | None = Field(None, ge=1)
    store: bool | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None


class MessageItem(Lenient):
    role: Literal["user", "assistant", "system", "developer"]
    content: Any


class FunctionCallItem(Lenient):
    call_id: str
    name: str
    arguments: Any = ""
    namespace: str | None = None


class CallOutputItem(Lenient):
    call_id: str
    output: Any = ""


class CustomCallItem(Lenient):
    call_id: str
    name: str
    input: str = ""


class ReasoningItem(Lenient):
    summary: list[Any] | None = None
    content: list[Any] | None = None
    encrypted_content: str | None = None


@dataclass(slots=True)
class ResponsesGenerationRequest(GenerationRequest):
    """GenerationRequest plus the request fields a Response object echoes back."""

    echo: dict[str, Any] = field(default_factory=dict)
    stored_input: list[dict[str, Any]] | None = None  # input items to store; None: not stored


# ---------------------------------------------------------------- decode: input items


class _History:
    """Folds Responses input items into chat messages (one assistant turn per run)."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.reasoning: list[str] = []
        self.call_names: dict[str, str] = {}

    def assistant(self, text: str = "", calls: tuple[ToolCall, ...] = ()) -> None:
        last = self.messages[-1] if self.messages else None
        mergeable = last is not None and last.role == "assistant" and not (text and last.tool_calls)
        if not mergeable:
            last = Message("assistant")
            self.messages.append(last)
        assert last is not None
        if text:
            last.content = f"{last.content}\n\n{text}" if last.content else text
        last.tool_calls.extend(calls)
        self.call_names.update((c.id, c.name) for c in calls)
        if self.reasoning:
            joined = "\n".join(self.reasoning)
            last.reasoning = f"{last.reasoning}\n{joined}" if last.reasoning else joined
            self.reasoning = []

    def add(self, item: Any, path: str) -> None:
        check(isinstance(item, dict), path, "expected an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            msg = validate(MessageItem, item, path)
            text = text_of_parts(msg.content, f"{path}.content", TEXT_PARTS, IMAGE_PARTS)
            if msg.role == "assistant":
                self.assistant(text)
            else:
                self.messages.append(
                    Message("system" if msg.role == "developer" else msg.role, text)
                )
        elif kind == "function_call":
            call = validate(FunctionCallItem, item, path)
            name = f"{call.namespace}.{call.name}" if call.namespace else call.name
            self.assistant(calls=(ToolCall(call.call_id, name, _arguments(call.arguments)),))
        elif kind == "custom_tool_call":
            custom = validate(CustomCallItem, item, path)
            args = json.dumps({"input": custom.input}, ensure_ascii=False)
            self.assistant(calls=(ToolCall(custom.call_id, custom.name, args),))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            out = validate(CallOutputItem, item, path)
            text = _output_text(out.output, f"{path}.output")
            called = self.call_names.get(out.call_id)
            self.messages.append(Message("tool", text, tool_call_id=out.call_id, name=called))
        elif kind == "reasoning":
            reasoning = validate(ReasoningItem, item, path)
            sealed = open_reasoning(reasoning.encrypted_content)
            texts = _part_texts(reasoning.content) or (
                [sealed] if sealed else _part_texts(reasoning.summary)
            )
            if texts:
                self.reasoning.append("\n".join(texts))
        elif kind == "item_reference":  # resolved before folding (openai_responses_state)
            raise invalid(f"'{path}': item_reference cannot be resolved here.", path)
        # other item types (web_search_call, tool_search_*, compaction...) are skipped


def _arguments(value: Any) -> str:
    if isinstance(value, str):
        return value
    return "{}" if value is None else json.dumps(value, ensure_ascii=False)


def _output_text(output: Any, path: str) -> str:
    if isinstance(output, (str, list)):
        return text_of_parts(output, path, TEXT_PARTS, IMAGE_PARTS)
    return "" if output is None else json.dumps(output, ensure_ascii=False)


def _part_texts(parts: list[Any] | None) -> list[str]:
    return [
        p["text"]
        for p in parts or []
        if isinstance(p, dict) and isinstance(p.get("text"), str) and p["text"]
    ]


def _messages(req: ResponsesRequestIn, resolved: ResolvedInput) -> list[Message]:
    history = _History()
    if req.instructions:
        history.messages.append(Message("system", req.instructions))
    for item in resolved.earlier:  # stored items: already validated when they were stored
        history.add(item, "previous_response_id")
    if isinstance(resolved.items, str):
        history.messages.append(Message("user", resolved.items))
    elif isinstance(resolved.items, list):
        for i, item in enumerate(resolved.items):
            history.add(item, f"input[{i}]")
    elif req.input is None:
        raise invalid("Missing required parameter: 'input'.", "input")
    else:
        raise invalid("Invalid type for 'input': expected a string or an array of items.", "input")
    check(bool(history.messages), "input", "expected at least one message")
    return _merge_leading_system(history.messages)


def _merge_leading_system(messages: list[Message]) -> list[Message]:
    """instructions + a leading developer message become one system message."""
    count = 0
    while count < len(messages) and messages[count].role == "system":
        count += 1
    if count < 2:
        return messages
    merged = Message("system", "\n\n".join(m.content for m in messages[:count]))
    return [merged, *messages[count:]]


# ---------------------------------------------------------------- decode: tools


def _function_spec(tool: dict[str, Any], path: str, namespace: str | None = None) -> ToolSpec:
    fn: Any = (
        tool.get("function") if isinstance(tool.get("function"), dict) else tool
    )  # chat shape too
    name, params = fn.get("name"), fn.get("parameters")
    check(isinstance(name, str) and name != "", f"{path}.name")
    check(params is None or isinstance(params, dict), f"{path}.parameters", "expected an object")
    spec = ToolSpec(f"{namespace}.{name}" if namespace else name, str(fn.get("description") or ""))
    if params:
        spec.parameters = params
    return spec


def _tools(raw: list[dict[str, Any]] | None) -> list[ToolSpec]:
    specs: list[ToolSpec] = []
    for i, tool in enumerate(raw or []):
        path = f"tools[{i}]"
        check(isinstance(tool, dict), path, "expected an object")
        kind = tool.get("type", "function")
        if kind == "function":
            specs.append(_function_spec(tool, path))
        elif kind == "namespace" and isinstance(tool.get("tools"), list):
            ns = tool.get("name")
            check(isinstance(ns, str) and ns != "", f"{path}.name")
            for j, inner in enumerate(tool["tools"]):
                if isinstance(inner, dict) and inner.get("type", "function") == "function":
                    specs.append(_function_spec(inner, f"{path}.tools[{j}]", ns))
        # custom, tool_search, web_search, file_search, mcp, ...: skipped, not an error
    return specs


def _tool_choice(raw: Any) -> ToolChoice:
    if (mode := tool_choice_mode(raw)) is not None:
        return mode
    if raw.get("type") == "function":
        name = raw.get("name")
        check(isinstance(name, str), "tool_choice.name")
        namespace = raw.get("namespace")
        return ToolChoice("function", f"{namespace}.{name}" if namespace else name)
    if raw.get("type") == "allowed_tools":
        mode = raw.get("mode", "auto")
        check(
            mode in ("auto", "required"),
            "tool_choice.mode",
            f"{mode!r} is not one of auto, required",
        )
        return ToolChoice(mode)
    return ToolChoice()  # hosted / custom tool choices: the model decides


def _allowed(raw: Any, tools: list[ToolSpec]) -> list[ToolSpec]:
    """tool_choice allowed_tools: only the listed functions may be called (hosted entries
    name tools we skip anyway)."""
    if not isinstance(raw, dict) or raw.get("type") != "allowed_tools":
        return tools
    listed: Any = raw.get("tools")
    check(isinstance(listed, list), "tool_choice.tools")
    names = set()
    for i, entry in enumerate(listed):
        check(isinstance(entry, dict), f"tool_choice.tools[{i}]", "expected an object")
        if entry.get("type", "function") == "function":
            check(isinstance(entry.get("name"), str), f"tool_choice.tools[{i}].name")
            namespace = entry.get("namespace")
            names.add(f"{namespace}.{entry['name']}" if namespace else entry["name"])
    return [tool for tool in tools if tool.name in names]


def _refuse_unhonoured(req: ResponsesRequestIn) -> None:
    """Parameters whose silent omission would give a wrong answer are a 400 naming them."""
    if req.conversation is not None:
        raise invalid(
            "conversation is not supported: this server stores no conversations.", "conversation"
        )
    if req.background:
        raise invalid("background responses are not supported.", "background")
    if req.prompt is not None:
        raise unsupported(
            "prompt", "stored prompt templates cannot be resolved; send 'instructions' and 'input'"
        )


def decode_responses(body: Any, state: ResponsesState | None = None) -> ResponsesGenerationRequest:
    req = validate(ResponsesRequestIn, body)
    _refuse_unhonoured(req)
    resolved = (state or ResponsesState()).resolve(req.input, req.previous_response_id, req.store)
    messages = _messages(req, resolved)
    choice = _tool_choice(req.tool_choice)
    tools = _allowed(req.tool_choice, _tools(req.tools))
    check_tool_choice(choice, tools, "tool_choice")
    effort = req.reasoning.effort if req.reasoning else None
    logprobs = LOGPROBS_INCLUDE in (req.include or []) or bool(req.top_logprobs)
    return ResponsesGenerationRequest(
        model=req.model,
        messages=messages,
        tools=tools,
        tool_choice=choice,
        sampling=sampling_params(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=None if req.top_k is None else max(req.top_k, 0),
            min_p=req.min_p,
            seed=seed_value(req.seed),
        ),
        max_tokens=req.max_output_tokens,
        stream=bool(req.stream),
        reasoning=reasoning_options(effort, "reasoning.effort"),
        logprobs=logprobs,
        top_logprobs=req.top_logprobs or 0,
        mock_response=req.mock_response,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        echo=_echo(req, stored=resolved.record is not None),
        stored_input=resolved.record,
        output_format=openai_output_format(
            (req.text or {}).get("format"), "text.format", flat=True
        ),
    )


def _echo(req: ResponsesRequestIn, stored: bool) -> dict[str, Any]:
    sent = {key: value for key, value in (req.text or {}).items() if value is not None}
    text = {"format": {"type": "text"}, "verbosity": "medium", **sent}
    reasoning = req.reasoning
    return {
        "instructions": req.instructions,
        "tools": req.tools or [],
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "max_output_tokens": req.max_output_tokens,
        "reasoning": {
            "effort": reasoning.effort if reasoning else None,
            "summary": reasoning.summary if reasoning else None,
        },
        "metadata": req.metadata or {},
        "text": text,
        "top_logprobs": req.top_logprobs or 0,
        "include": req.include or [],
        "truncation": req.truncation or "disabled",
        "max_tool_calls": req.max_tool_calls,
        "user": req.user,
        "safety_identifier": req.safety_identifier,
        "prompt_cache_key": req.prompt_cache_key,
        "prompt_cache_retention": req.prompt_cache_retention,
        "store": stored,
        "previous_response_id": req.previous_response_id,
    }


# ---------------------------------------------------------------- protocol


def _echo_of(ctx: RequestContext) -> dict[str, Any]:
    request = ctx.request
    return request.echo if isinstance(request, ResponsesGenerationRequest) else {}


@register_protocol
class OpenAIResponses(WireProtocol):
    name = "openai-responses"
    stores_responses: ClassVar[bool] = True

    def __init__(self) -> None:
        self.state = ResponsesState()  # stateless until the app gives it a store

    def use_store(self, store: ResponseStore) -> None:
        self.state = ResponsesState(store)

    def decode(self, body: Any, meta: RequestMeta) -> GenerationRequest:
        return decode_responses(body, self.state)

    def keep(self, ctx: RequestContext, response: dict[str, Any]) -> None:
        """Store the finished response (before the client can see it end)."""
        request = ctx.request
        if isinstance(request, ResponsesGenerationRequest):
            self.state.keep(request.stored_input, response)

    def encode_json(self, events: Iterator[Event], ctx: RequestContext) -> dict[str, Any]:
        """The response of the last stream event (response.completed / .incomplete)."""
        try:
            frames = list(json_frames(ResponseEvents(ctx, self.keep), events, ctx))
        finally:
            close_events(events)
        last = frames[-1].data
        assert isinstance(last, dict)
        response: dict[str, Any] = last["response"]
        return response

    def encode_stream(self, events: Iterator[Event], ctx: RequestContext) -> Iterator[bytes]:
        try:
            yield from sse_frames(ResponseEvents(ctx, self.keep), events, ctx)
        finally:
            close_events(events)

    def stream_fault(self, error: ApiError, events_sent: int) -> dict[str, Any]:
        """Responses streams carry errors as a typed `error` event with the next
        sequence number (the SDK's ResponseErrorEvent)."""
        detail = self.error_body(error)["error"]
        return {"type": "error", "code": detail["code"] or detail["type"], "message": detail["message"],
                "param": detail["param"], "sequence_number": events_sent}  # fmt: skip

    def error_body(self, error: ApiError) -> dict[str, Any]:
        body = openai_error_body(error)
        if body["error"]["param"] == "messages":  # stages name the prompt as Chat does
            body["error"]["param"] = "input"
        return body


class ResponseEvents(EventEncoder):
    """The Responses stream events of one request (ResponsesBuilder's), for the shared
    base (api/framing.py). The finished response is stored before its last event."""

    def __init__(
        self, ctx: RequestContext, keep: Callable[[RequestContext, dict[str, Any]], None]
    ) -> None:
        self.ctx = ctx
        self.builder = ResponsesBuilder(ctx, _echo_of(ctx))
        self.keep = keep

    def open(self) -> list[Frame]:
        return _wire(self.builder.start())

    def feed(self, event: Event) -> list[Frame]:
        return _wire(self.builder.feed(event))

    def close(self) -> list[Frame]:
        try:
            final = self.builder.final()
        except ApiError as err:
            return self.error(err)
        last = final[-1]
        if isinstance(last, dict):
            self.keep(self.ctx, last["response"])
        return _wire(final)

    def error(self, err: ApiError) -> list[Frame]:
        failed = self.builder.failed(err)
        return [Frame(failed, failed["type"], error=err)]


def _wire(events: list[dict[str, Any] | bytes]) -> list[Frame]:
    return [Frame(event, event["type"]) for event in events if isinstance(event, dict)]


__all__ = ["OpenAIResponses", "ResponsesGenerationRequest", "decode_responses"]
