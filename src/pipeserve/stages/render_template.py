"""render_template: turn the normalized request into the prompt (text and token ids).

Two renderers:
- `chat_template`: the model tokenizer's own chat template, rendered by transformers
  (sandboxed jinja) from OpenAI-style message dicts, tools as JSON-schema functions;
- `harmony`: openai-harmony's renderer for GPT-OSS (see render_harmony.py).

Per request (prepare) it sets ctx.prompt, ctx.prompt_token_ids and
ctx.prompt_opened_thinking (the rendered prompt, right-stripped, ends with think_start).
A raw prompt is tokenized as is; a fill-in-the-middle one (RawPrompt.fim) is laid out
with the vocabulary's FIM tokens (stages/fim.py, in render_base.py), which also sets
ctx.stop_token_ids.
The stage passes events through untouched.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from jinja2 import TemplateError

from pipeserve.engine.weights.chat_templates import no_template_message
from pipeserve.errors import ApiError
from pipeserve.request import GenerationRequest, Message, ToolSpec
from pipeserve.stages.base import BuildEnv, Stage, register_stage
from pipeserve.stages.render_base import RenderParams, RenderStage
from pipeserve.stages.render_harmony import HarmonyStage

log = logging.getLogger("pipeserve.stages")


class ChatTemplateStage(RenderStage):
    """Renders with the HF tokenizer's chat template (as transformers does)."""

    def __init__(self, params: RenderParams, env: BuildEnv) -> None:
        super().__init__(params, env)
        if env.runtime is not None:  # compile (transformers caches it) and fail at startup
            tokenizer = self.tokenizer()
            if not getattr(tokenizer, "chat_template", None):
                log.warning("%s", no_template_message(env.model_name))
                return
            try:
                tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
            except (TemplateError, ValueError) as exc:
                raise ValueError(
                    f"model {env.model_name!r}: its chat template does not render: {exc}"
                ) from exc

    def render(self, request: GenerationRequest) -> tuple[str, list[int]]:
        tokenizer = self.tokenizer()
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError("invalid_request", no_template_message(self.env.model_name), "messages")
        tools = None if request.tool_choice.mode == "none" else template_tools(request.tools)
        continuing = self.params.continue_final_assistant and is_prefill(request.messages)
        messages = template_messages(request.messages)
        if self.params.system_role == "fold":
            messages = fold_system(messages)
        try:
            prompt = tokenizer.apply_chat_template(
                messages,
                tools=tools or None,
                add_generation_prompt=not continuing,
                continue_final_message=continuing,
                tokenize=False,
                **self.template_kwargs(request),
            )
        except (TemplateError, ValueError) as exc:
            message = f"The chat template rejected the conversation: {exc}"
            raise ApiError("invalid_request", message, "messages") from exc
        return prompt, list(tokenizer.encode(prompt, add_special_tokens=False))

    def template_kwargs(self, request: GenerationRequest) -> dict[str, Any]:
        kwargs = {**self.params.chat_template_kwargs, **request.template_kwargs}
        switch = self.params.thinking_switch
        if switch and request.reasoning.enabled is not None:
            kwargs[switch] = request.reasoning.enabled
        if request.reasoning.effort is not None:
            kwargs["reasoning_effort"] = request.reasoning.effort
        if switch and request.tool_choice.mode in ("required", "function"):
            kwargs[switch] = False  # the tool_calls stage prefills the call
        return kwargs


def is_prefill(messages: list[Message]) -> bool:
    """The conversation ends with assistant text to continue (Anthropic-style prefill)."""
    last = messages[-1] if messages else None
    return (
        last is not None and last.role == "assistant" and not last.tool_calls and bool(last.content)
    )


def template_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """OpenAI-style message dicts, the shape chat templates expect."""
    names = {call.id: call.name for m in messages for call in m.tool_calls}
    out: list[dict[str, Any]] = []
    for message in messages:
        item: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.reasoning is not None:
            item["reasoning_content"] = message.reasoning
        if message.tool_calls:
            item["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call_arguments(call.arguments)},
                }
                for call in message.tool_calls
            ]
        if message.role == "tool":
            item["tool_call_id"] = message.tool_call_id
            item["name"] = message.name or names.get(message.tool_call_id or "")
        out.append(item)
    return out


def fold_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """System (and developer) text moved to the start of the first user turn, separated
    by a blank line, for templates that have no system role."""
    system = [str(m["content"] or "") for m in messages if m["role"] in ("system", "developer")]
    rest = [m for m in messages if m["role"] not in ("system", "developer")]
    text = "\n\n".join(part for part in system if part)
    if not text:
        return rest
    for i, message in enumerate(rest):
        if message["role"] == "user":
            body = message["content"]
            joined = f"{text}\n\n{body}" if isinstance(body, str) and body else text
            return [*rest[:i], {**message, "content": joined}, *rest[i + 1 :]]
    return [{"role": "user", "content": text}, *rest]


def call_arguments(arguments: str) -> Any:
    """Arguments as a mapping when they are a JSON object (templates iterate them)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def template_tools(tools: list[ToolSpec]) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
        }
        for t in tools
    ]


@register_stage("render_template", RenderParams, role="render")
def render_template(params: RenderParams, env: BuildEnv) -> Stage:
    """Render the request into the model's prompt (chat template or Harmony)."""
    if params.renderer == "harmony":
        return HarmonyStage(params, env)
    return ChatTemplateStage(params, env)
