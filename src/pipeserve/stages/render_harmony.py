"""The `harmony` renderer of render_template: GPT-OSS prompts built by openai-harmony.

system (reasoning effort) -> developer (instructions from system messages + tools as
the `functions` namespace) -> user / assistant turns (reasoning on the analysis channel,
answers on final, tool calls on commentary to functions.NAME) -> tool results from
functions.NAME to the assistant; then `render_conversation_for_completion(conv,
Role.ASSISTANT)` gives the token ids.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from pipeserve.errors import ApiError
from pipeserve.request import GenerationRequest, Message
from pipeserve.stages.base import BuildEnv
from pipeserve.stages.render_base import RenderParams, RenderStage

SYSTEM_KWARGS = ("model_identity", "knowledge_cutoff", "conversation_start_date")
EFFORTS = {"minimal": "LOW", "low": "LOW", "medium": "MEDIUM", "high": "HIGH"}


@functools.cache
def harmony_encoding() -> Any:
    """openai-harmony's GPT-OSS encoding, loaded offline (our o200k_base.tiktoken)."""
    if not os.environ.get("TIKTOKEN_ENCODINGS_BASE"):
        from pipeserve.engine.weights.demo.build import ensure_tiktoken_base

        ensure_tiktoken_base()
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


class HarmonyStage(RenderStage):
    def __init__(self, params: RenderParams, env: BuildEnv) -> None:
        super().__init__(params, env)
        unknown = set(params.chat_template_kwargs) - set(SYSTEM_KWARGS)
        if unknown:
            raise ValueError(
                f"harmony renderer: unknown chat_template_kwargs {sorted(unknown)}; "
                f"allowed: {', '.join(SYSTEM_KWARGS)}"
            )
        self.encoding = harmony_encoding()

    def render(self, request: GenerationRequest) -> tuple[str, list[int]]:
        from openai_harmony import HarmonyError, Role

        try:
            conversation = self.conversation(request)
            tokens = self.encoding.render_conversation_for_completion(conversation, Role.ASSISTANT)
        except HarmonyError as exc:
            raise ApiError(
                "invalid_request", f"Cannot render the conversation: {exc}", "messages"
            ) from exc
        return self.encoding.decode(tokens), list(tokens)

    def conversation(self, request: GenerationRequest) -> Any:
        from openai_harmony import Conversation, Role
        from openai_harmony import Message as HMessage

        messages = [HMessage.from_role_and_content(Role.SYSTEM, self.system_content(request))]
        developer = developer_content(request)
        if developer is not None:
            messages.append(HMessage.from_role_and_content(Role.DEVELOPER, developer))
        names = {call.id: call.name for m in request.messages for call in m.tool_calls}
        for message in request.messages:
            messages.extend(harmony_messages(message, names))
        return Conversation.from_messages(messages)

    def system_content(self, request: GenerationRequest) -> Any:
        from openai_harmony import ReasoningEffort, SystemContent

        content = SystemContent.new()
        for key in SYSTEM_KWARGS:
            if key in self.params.chat_template_kwargs:
                content = getattr(content, f"with_{key}")(self.params.chat_template_kwargs[key])
        effort = request.reasoning.effort
        if effort is None and request.reasoning.enabled is False:
            effort = "low"  # GPT-OSS always reasons; "off" is the least effort
        if effort is not None:
            content = content.with_reasoning_effort(getattr(ReasoningEffort, EFFORTS[effort]))
        return content


def developer_content(request: GenerationRequest) -> Any | None:
    from openai_harmony import DeveloperContent, ToolDescription

    instructions = "\n\n".join(
        m.content for m in request.messages if m.role == "system" and m.content
    )
    tools = [] if request.tool_choice.mode == "none" else request.tools
    if not instructions and not tools:
        return None
    content = DeveloperContent.new()
    if instructions:
        content = content.with_instructions(instructions)
    if tools:
        content = content.with_function_tools(
            [ToolDescription.new(t.name, t.description, parameters=t.parameters) for t in tools]
        )
    return content


def harmony_messages(message: Message, names: dict[str, str]) -> list[Any]:
    """One request message as Harmony messages (system text goes to the developer)."""
    from openai_harmony import Author, Role
    from openai_harmony import Message as HMessage

    if message.role == "user":
        return [HMessage.from_role_and_content(Role.USER, message.content)]
    if message.role == "tool":
        name = message.name or names.get(message.tool_call_id or "") or "tool"
        author = Author.new(Role.TOOL, f"functions.{name}")
        return [
            HMessage.from_author_and_content(author, message.content)
            .with_channel("commentary")
            .with_recipient("assistant")
        ]
    if message.role != "assistant":
        return []
    out = []
    if message.reasoning:
        out.append(
            HMessage.from_role_and_content(Role.ASSISTANT, message.reasoning).with_channel(
                "analysis"
            )
        )
    if message.content:
        channel = "commentary" if message.tool_calls else "final"  # a preamble before calls
        out.append(
            HMessage.from_role_and_content(Role.ASSISTANT, message.content).with_channel(channel)
        )
    for call in message.tool_calls:
        out.append(
            HMessage.from_role_and_content(Role.ASSISTANT, call.arguments)
            .with_channel("commentary")
            .with_recipient(f"functions.{call.name}")
            .with_content_type("<|constrain|>json")
        )
    return out
