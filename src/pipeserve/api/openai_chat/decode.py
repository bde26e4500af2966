"""OpenAI Chat Completions request body -> ChatGenerationRequest.

Unknown body fields are accepted and ignored; malformed known fields are a 400 naming the
field (`messages[2].content[0].text`), and so are known fields we cannot honour when
ignoring them would silently change the answer (n > 1, JSON response formats, audio, the
legacy functions API). `logit_bias` is applied with this model's token ids (as other
open-model servers do; ids outside its vocabulary are a 400).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pipeserve.api.openai_chat.schema import ChatRequestIn, MessageIn
from pipeserve.api.openai_chat.template_kwargs import decode_template_kwargs
from pipeserve.api.openai_common import (
    check,
    check_tool_choice,
    choices_of,
    reasoning_options,
    text_of_parts,
    tool_choice_mode,
    unsupported,
    validate,
)
from pipeserve.api.structured import openai_output_format
from pipeserve.errors import invalid
from pipeserve.request import (
    GenerationRequest,
    Message,
    ToolCall,
    ToolChoice,
    ToolSpec,
)

TEXT_PARTS = frozenset({"text", "input_text"})
IMAGE_PARTS = frozenset({"image_url", "input_image", "input_audio", "file", "image"})


@dataclass(slots=True)
class ChatGenerationRequest(GenerationRequest):
    """GenerationRequest plus the Chat-only facts its encoder needs."""

    include_usage: bool = False


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
        strict = fn.get("strict")
        check(
            strict is None or isinstance(strict, bool),
            f"{path}.function.strict",
            "expected a boolean",
        )
        spec = ToolSpec(name, str(fn.get("description") or ""), strict=strict is True)
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


def prediction_of(raw: Any) -> str | None:
    """Predicted Outputs: `{"type": "content", "content": text or text parts}`; the
    engine proposes from the text, so a wrong prediction only costs speed."""
    if raw is None:
        return None
    check(isinstance(raw, dict), "prediction", "expected an object")
    for key in raw:
        check(key in ("type", "content"), f"prediction.{key}", "unknown field")
    check(raw.get("type") == "content", "prediction.type", "expected 'content'")
    content = raw.get("content")
    if isinstance(content, list):
        check(
            all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content),
            "prediction.content",
            "expected a string or an array of text parts",
        )  # fmt: skip
        content = "".join(p["text"] for p in content)
    check(
        isinstance(content, str),
        "prediction.content",
        "expected a string or an array of text parts",
    )
    return content or None


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
    choices = choices_of(req.n)
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
        prediction=prediction_of(req.prediction),
        n=choices,
    )


__all__ = ["ChatGenerationRequest", "decode_chat", "stop_of"]
