"""OpenAI Responses request body -> ResponsesGenerationRequest.

With the response store (state.py), `previous_response_id` and `item_reference` inputs
are resolved and responses are stored; without it they are refused (400 naming them) and
clients resend the history (as Codex does). `conversation` and `prompt` are always
refused. `_echo` gathers the request fields a Response object echoes back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pipeserve.api.openai_common import (
    check,
    check_tool_choice,
    reasoning_options,
    seed_value,
    text_of_parts,
    tool_choice_mode,
    unsupported,
    validate,
)
from pipeserve.api.openai_responses.encode import open_reasoning
from pipeserve.api.openai_responses.schema import (
    CallOutputItem,
    CustomCallItem,
    FunctionCallItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequestIn,
)
from pipeserve.api.openai_responses.state import ResolvedInput, ResponsesState
from pipeserve.api.structured import openai_output_format
from pipeserve.errors import invalid
from pipeserve.request import (
    GenerationRequest,
    Message,
    ToolCall,
    ToolChoice,
    ToolSpec,
    sampling_params,
)
from pipeserve.store.base import NOBODY_IN_PARTICULAR, Owner

TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text"})
IMAGE_PARTS = frozenset({"input_image", "input_file", "input_audio", "image_url"})
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# `include` asks for extra output. Ours are logprobs and reasoning.encrypted_content; other
# values (hosted tools, input images, and any an agent CLI adds later) add nothing here and
# are ignored, so a newer client is not refused for asking for more.


@dataclass(slots=True)
class ResponsesGenerationRequest(GenerationRequest):
    """GenerationRequest plus the request fields a Response object echoes back."""

    echo: dict[str, Any] = field(default_factory=dict)
    stored_input: list[dict[str, Any]] | None = None  # input items to store; None: not stored
    store_owner: Owner = NOBODY_IN_PARTICULAR  # whose the stored response will be


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
        elif kind == "item_reference":  # resolved before folding (state.py)
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
        raise invalid(INPUT_TYPE, "input")
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
    strict = fn.get("strict")
    check(strict is None or isinstance(strict, bool), f"{path}.strict", "expected a boolean")
    # Responses function tools are strict unless they say otherwise (the API's default;
    # the openai SDK always sends the field): arguments are enforced by a grammar.
    spec = ToolSpec(
        f"{namespace}.{name}" if namespace else name,
        str(fn.get("description") or ""),
        strict=strict is not False,
    )
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


INPUT_TYPE = "Invalid type for 'input': expected a string or an array of items."


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


def decode_responses(
    body: Any, state: ResponsesState | None = None, owner: Owner = NOBODY_IN_PARTICULAR
) -> ResponsesGenerationRequest:
    req = validate(ResponsesRequestIn, body)
    _refuse_unhonoured(req)
    if req.input is not None and not isinstance(req.input, str | list):
        raise invalid(INPUT_TYPE, "input")  # before the store reads it as items
    resolved = (state or ResponsesState()).resolve(
        req.input, req.previous_response_id, req.store, owner
    )
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
        store_owner=owner,
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


__all__ = ["ResponsesGenerationRequest", "decode_responses"]
