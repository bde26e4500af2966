"""Ollama `/api/chat` and `/api/generate` bodies -> the protocol-neutral GenerationRequest.

Field names follow Ollama's API reference (docs/api.md) and its Python client:
- `options`: temperature, top_p, top_k, min_p, seed, stop, num_predict (-1 / -2: the
  model's default), repeat_penalty, presence_penalty, frequency_penalty; other options
  (num_ctx, num_gpu, mirostat, ...) tune Ollama's own runtime and are ignored.
- `think`: true / false, or "low" / "medium" / "high" (thinking on, at that effort).
- `stream` defaults to true, as in Ollama. `keep_alive` is accepted and ignored (model
  residency is the server's YAML).
- Chat tool calls carry `function.arguments` as an object; Ollama has no call ids, so
  each call gets one and tool results (role `tool`, `tool_name`) answer them in order.
- /api/generate: `system` + `prompt` become a chat turn rendered with the model's
  template; `raw: true` sends the prompt as is (no template, output not parsed).
  `suffix` (non-empty) asks for fill-in-the-middle: `prompt` is the text before the
  hole (it may be empty), the answer the text between it and the suffix, laid out with
  the model's FIM tokens (a model without them: a 400 naming `suffix`); `system` has no
  place in that layout and is a 400 with it.
- `format`: "json" or a JSON schema, enforced while decoding (structured output).
- `logprobs` / `top_logprobs` (0-20): each content chunk carries its tokens' logprobs.
- Refused with a 400 naming the field, since ignoring it would change the answer:
  `images`, `template`, `context`, and an empty `messages` / `prompt` without a
  `suffix` (Ollama's "load the model" call).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pipeserve.api.ollama.schema import (
    ChatIn,
    CommonIn,
    GenerateIn,
    MessageIn,
    OptionsIn,
    ToolCallIn,
)
from pipeserve.api.openai_common import check, seed_value, unsupported, validate
from pipeserve.errors import invalid
from pipeserve.request import (
    FillInMiddle,
    GenerationRequest,
    Message,
    OutputFormat,
    RawPrompt,
    ReasoningOptions,
    SamplingParams,
    ToolCall,
    ToolSpec,
    sampling_params,
)

EFFORTS = ("low", "medium", "high")


@dataclass(slots=True)
class OllamaGenerationRequest(GenerationRequest):
    """GenerationRequest plus which endpoint answers (the encoder's shape)."""

    endpoint: Literal["chat", "generate"] = "chat"


def decode_ollama(body: Any, endpoint: Literal["chat", "generate"]) -> OllamaGenerationRequest:
    if endpoint == "chat":
        chat = validate(ChatIn, body)
        request = common(chat, endpoint)
        request.messages = messages(chat.messages or [])
        request.tools = tools(chat.tools or [])
        return request
    generate = validate(GenerateIn, body)
    refuse_generate_fields(generate)
    request = common(generate, endpoint)
    if generate.suffix:
        check(not generate.system, "system", "a fill-in-the-middle prompt has no system part")
        fim = FillInMiddle(suffix=generate.suffix, param="suffix")
        request.raw_prompt = RawPrompt(text=generate.prompt or "", fim=fim)
        return request
    check(bool(generate.prompt), "prompt", "an empty prompt (loading a model) is not served")
    if generate.raw:
        request.raw_prompt = RawPrompt(text=generate.prompt)
        return request
    request.messages = [Message("system", generate.system)] if generate.system else []
    request.messages.append(Message("user", generate.prompt or ""))
    return request


def common(req: CommonIn, endpoint: Literal["chat", "generate"]) -> OllamaGenerationRequest:
    options = req.options or OptionsIn()
    stops = options.stop or []
    for i, stop in enumerate(stops):
        check(stop != "", f"options.stop[{i}]", "stop sequences must not be empty")
    return OllamaGenerationRequest(
        model=req.model.removesuffix(":latest"),
        messages=[],
        sampling=sampling(options),
        max_tokens=options.num_predict if (options.num_predict or 0) > 0 else None,
        stop=list(dict.fromkeys(stops)),
        stream=req.stream is not False,
        reasoning=reasoning(req.think),
        output_format=output_format(req.format),
        logprobs=bool(req.logprobs),
        top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
        mock_response=req.mock_response,
        endpoint=endpoint,
    )


def output_format(raw: Any) -> OutputFormat | None:
    """`format`: "json" (any JSON object) or a JSON schema, enforced while decoding."""
    if raw in (None, ""):
        return None
    if raw == "json":
        return OutputFormat("json_object", param="format")
    check(isinstance(raw, dict), "format", 'expected "json" or a JSON schema object')
    return OutputFormat("json_schema", raw, param="format")


def refuse_generate_fields(req: GenerateIn) -> None:
    if req.images:
        raise invalid("images are not supported by this model", "images")
    if req.template not in (None, ""):
        raise unsupported("template", "the model's own chat template is always used")
    if req.context:
        raise unsupported("context", "send the conversation to /api/chat instead")


def sampling(options: OptionsIn) -> SamplingParams:
    # Options left out take the model's sampling defaults (YAML / generation_config.json).
    return sampling_params(
        temperature=options.temperature,
        top_p=options.top_p,
        top_k=None if options.top_k is None else max(options.top_k, 0),
        min_p=options.min_p,
        repetition_penalty=None
        if options.repeat_penalty is None
        else options.repeat_penalty or 1.0,
        presence_penalty=options.presence_penalty,
        frequency_penalty=options.frequency_penalty,
        seed=seed_value(options.seed),
    )


def reasoning(think: bool | str | None) -> ReasoningOptions:
    if think is None or isinstance(think, bool):
        return ReasoningOptions(enabled=think)
    check(think in EFFORTS, "think", f"expected true, false or one of {', '.join(EFFORTS)}")
    return ReasoningOptions(enabled=True, effort=think)  # type: ignore[arg-type]


def messages(raw: list[MessageIn]) -> list[Message]:
    check(bool(raw), "messages", "at least one message is required")
    out: list[Message] = []
    unanswered: list[ToolCall] = []  # calls of the last assistant turn, answered in order
    for i, item in enumerate(raw):
        if item.images:
            raise invalid("images are not supported by this model", f"messages[{i}].images")
        if item.role == "assistant":
            calls = [call(c, f"call_{i}_{j}") for j, c in enumerate(item.tool_calls or [])]
            out.append(Message("assistant", item.content or "", item.thinking, calls))
            unanswered = list(calls)
        elif item.role == "tool":
            answered = next((c for c in unanswered if c.name == item.tool_name), None)
            answered = answered or (unanswered[0] if unanswered else None)
            if answered is not None:
                unanswered.remove(answered)
            call_id = answered.id if answered else None
            name = item.tool_name or (answered.name if answered else None)
            out.append(Message("tool", item.content or "", tool_call_id=call_id, name=name))
        else:
            out.append(Message(item.role, item.content or ""))
    return out


def call(raw: ToolCallIn, call_id: str) -> ToolCall:
    arguments = raw.function.arguments
    text = arguments if isinstance(arguments, str) else json.dumps(arguments or {})
    return ToolCall(call_id, raw.function.name, text)


def tools(raw: list[dict[str, Any]]) -> list[ToolSpec]:
    specs: list[ToolSpec] = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        check(isinstance(tool, dict), where, "expected an object")
        fn: Any = tool.get("function")
        check(isinstance(fn, dict), f"{where}.function")
        name, params = fn.get("name"), fn.get("parameters")
        check(isinstance(name, str) and name != "", f"{where}.function.name")
        check(params is None or isinstance(params, dict), f"{where}.function.parameters")
        spec = ToolSpec(name, str(fn.get("description") or ""))
        if params:
            spec.parameters = params
        specs.append(spec)
    return specs


__all__ = ["OllamaGenerationRequest", "decode_ollama"]
