"""Anthropic Messages request body -> protocol-neutral GenerationRequest.

Mapping rules (see also schema.py for field validation):
- `system` (string or text blocks) and `role: "system"` messages (Claude Code) become
  system messages; consecutive messages of one role are merged, as Anthropic does.
- A user message's `tool_result` blocks become `tool` messages, followed by a user
  message with the remaining text. Assistant `tool_use` -> ToolCall (input as JSON
  text), `thinking` -> reasoning, `redacted_thinking` is dropped (we cannot read it).
- Server-tool blocks in assistant turns (server_tool_use, *_tool_result, mcp_tool_use)
  are dropped like the server tools themselves; other unknown blocks are a 400.
- Custom tools (no `type`, or `type: "custom"`) are kept; server tools are skipped.
- `thinking.budget_tokens` must be >= 1024 (as the API enforces) and at most 2^24, but
  may exceed max_tokens (interleaved thinking, which Claude Code relies on). It is
  enforced: past it the engine closes the think block and the answer follows
  (stages/generate.py `thinking_limit`; the model's `reasoning.max_thinking_tokens` caps it).
- Structured outputs (`output_config.format`, the beta `output_format`) become an
  OutputFormat enforced while decoding (api/structured.py); `output_config.effort` is read
  leniently. metadata, service_tier, container, mcp_servers, context_management, speed
  and inference_geo are accepted and ignored.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

from pipeserve.api.anthropic_messages import schema as s
from pipeserve.api.structured import anthropic_output_format
from pipeserve.config.models import MAX_THINKING_BUDGET
from pipeserve.errors import invalid
from pipeserve.request import (
    GenerationRequest,
    Message,
    OutputFormat,
    ReasoningEffort,
    ReasoningOptions,
    SamplingParams,
    ToolCall,
    ToolChoice,
    ToolSpec,
    sampling_params,
)

Loc: TypeAlias = tuple[str | int, ...]
JOIN = "\n"  # between text blocks of one message
MERGE = "\n\n"  # between merged consecutive messages of one role
MIN_THINKING_BUDGET = 1024
EFFORTS: dict[str, ReasoningEffort] = {
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "high",
    "max": "high",
}
SKIPPED_ASSISTANT_BLOCKS = frozenset(
    {"redacted_thinking", "server_tool_use", "mcp_tool_use", "container_upload"}
)
IMAGES_UNSUPPORTED = "images are not supported by this model"


@dataclass(slots=True)
class AnthropicGenerationRequest(GenerationRequest):
    """GenerationRequest plus the Anthropic-only facts its encoder needs."""

    omit_thinking: bool = False  # thinking.display "omitted": blocks keep only a signature
    # Thinking blocks only when the request enables thinking, as the API does; otherwise
    # the template renders with thinking off where the family can, and any reasoning the
    # model still produces is left out of the answer (its tokens still count in usage).
    show_thinking: bool = True


def decode_body(body: Any, *, count_tokens: bool = False) -> AnthropicGenerationRequest:
    model = s.CountTokensBody if count_tokens else s.MessagesBody
    req = s.check(model, body)
    if not req.messages:
        raise invalid("messages: at least one message is required", "messages")
    tools = decode_tools(req.tools or [])
    choice, parallel = decode_tool_choice(req.tool_choice, tools)
    return AnthropicGenerationRequest(
        model=req.model,
        messages=decode_messages(req.messages, req.system),
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        sampling=decode_sampling(req),
        max_tokens=req.max_tokens,
        stop=decode_stop(req.stop_sequences or []),
        stream=bool(req.stream),
        reasoning=decode_reasoning(req.thinking, req.output_config),
        mock_response=req.mock_response,
        omit_thinking=req.thinking is not None and req.thinking.display == "omitted",
        output_format=decode_output_format(req),
        show_thinking=req.thinking is not None and req.thinking.type != "disabled",
    )


def decode_output_format(req: s.MessagesBody) -> OutputFormat | None:
    """output_config.format (GA) or the beta's output_format: a JSON schema to enforce."""
    config = req.output_config.format if req.output_config else None
    if config is not None:
        return anthropic_output_format(config, "output_config.format")
    return anthropic_output_format(req.output_format, "output_format")


# -- content blocks -------------------------------------------------------------------


def blocks_of(content: Any, loc: Loc) -> list[dict[str, Any]]:
    """String content is one text block; anything else must be a list of objects."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        where = s.path(loc)
        raise invalid(f"{where}: Input should be a valid string or a list of content blocks", where)
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            where = s.path((*loc, i, "type"))
            raise invalid(
                f"{where}: each content block must be an object with a string type", where
            )
    return content


def unsupported(block: dict[str, Any], loc: Loc, where_text: str) -> Exception:
    if block["type"] == "image":
        return invalid(IMAGES_UNSUPPORTED, s.path(loc))
    where = s.path((*loc, "type"))
    return invalid(
        f"{where}: content blocks of type {block['type']!r} are not supported {where_text}", where
    )


def plain_text(block: dict[str, Any], loc: Loc) -> str | None:
    """Text of a text / document / search_result block; None for other block types."""
    kind = block["type"]
    if kind == "text":
        return s.check(s.TextBlock, block, loc).text
    if kind == "document":
        return document_text(s.check(s.DocumentBlock, block, loc), loc)
    if kind == "search_result":
        result = s.check(s.SearchResultBlock, block, loc)
        body = text_blocks(result.content, (*loc, "content"))
        return JOIN.join(part for part in (result.title, result.source, body) if part)
    return None


def document_text(doc: s.DocumentBlock, loc: Loc) -> str:
    source = doc.source
    if source.get("type") == "text" and isinstance(source.get("data"), str):
        body = source["data"]
    elif source.get("type") == "content":
        inner: Loc = (*loc, "source", "content")
        body = text_blocks(blocks_of(source.get("content"), inner), inner)
    else:
        where = s.path((*loc, "source", "type"))
        raise invalid(
            f"{where}: only text documents are supported (not {source.get('type')!r})", where
        )
    return JOIN.join(part for part in (doc.title, doc.context, body) if part)


def text_blocks(blocks: list[dict[str, Any]], loc: Loc) -> str:
    parts: list[str] = []
    for i, block in enumerate(blocks):
        text = plain_text(block, (*loc, i))
        if text is None:
            raise unsupported(block, (*loc, i), "here")
        parts.append(text)
    return JOIN.join(parts)


# -- messages -------------------------------------------------------------------------


def decode_messages(params: list[s.MessageParam], system: Any) -> list[Message]:
    out: list[Message] = []
    if system is not None:
        text = text_blocks(blocks_of(system, ("system",)), ("system",))
        if text:
            out.append(Message(role="system", content=text))
    tool_names: dict[str, str] = {}
    for i, param in enumerate(params):
        loc: Loc = ("messages", i, "content")
        blocks = blocks_of(param.content, loc)
        if param.role == "assistant":
            out.append(assistant_message(blocks, loc, tool_names))
        elif param.role == "user":
            out.extend(user_messages(blocks, loc, tool_names))
        else:
            out.append(Message(role="system", content=text_blocks(blocks, loc)))
    return merge_same_role(out)


def user_messages(
    blocks: list[dict[str, Any]], loc: Loc, tool_names: dict[str, str]
) -> list[Message]:
    results: list[Message] = []
    texts: list[str] = []
    for i, block in enumerate(blocks):
        if block["type"] == "tool_result":
            result = s.check(s.ToolResultBlock, block, (*loc, i))
            results.append(tool_message(result, (*loc, i), tool_names))
            continue
        text = plain_text(block, (*loc, i))
        if text is None:
            raise unsupported(block, (*loc, i), "in user messages")
        texts.append(text)
    if texts or not results:
        results.append(Message(role="user", content=JOIN.join(texts)))
    return results


def tool_message(result: s.ToolResultBlock, loc: Loc, tool_names: dict[str, str]) -> Message:
    content = result.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        text = text_blocks(blocks_of(content, (*loc, "content")), (*loc, "content"))
    name = tool_names.get(result.tool_use_id)
    return Message(role="tool", content=text, tool_call_id=result.tool_use_id, name=name)


def assistant_message(
    blocks: list[dict[str, Any]], loc: Loc, tool_names: dict[str, str]
) -> Message:
    message = Message(role="assistant")
    texts: list[str] = []
    reasoning: list[str] = []
    for i, block in enumerate(blocks):
        kind = block["type"]
        if kind == "tool_use":
            use = s.check(s.ToolUseBlock, block, (*loc, i))
            tool_names[use.id] = use.name
            message.tool_calls.append(
                ToolCall(use.id, use.name, json.dumps(use.input, ensure_ascii=False))
            )
        elif kind == "thinking":
            reasoning.append(s.check(s.ThinkingBlock, block, (*loc, i)).thinking)
        elif kind not in SKIPPED_ASSISTANT_BLOCKS and not kind.endswith("_tool_result"):
            text = plain_text(block, (*loc, i))
            if text is None:
                raise unsupported(block, (*loc, i), "in assistant messages")
            texts.append(text)
    message.content = JOIN.join(texts)
    message.reasoning = JOIN.join(reasoning) if reasoning else None
    return message


def merge_same_role(messages: list[Message]) -> list[Message]:
    merged: list[Message] = []
    for message in messages:
        last = merged[-1] if merged else None
        if last is None or last.role != message.role or message.role == "tool":
            merged.append(message)
            continue
        last.content = join_nonempty(last.content, message.content)
        if message.reasoning is not None:
            last.reasoning = join_nonempty(last.reasoning or "", message.reasoning)
        last.tool_calls.extend(message.tool_calls)
    return merged


def join_nonempty(first: str, second: str) -> str:
    return MERGE.join(part for part in (first, second) if part)


# -- tools, sampling, reasoning -------------------------------------------------------


def decode_tools(raw: list[Any]) -> list[ToolSpec]:
    tools: list[ToolSpec] = []
    for i, entry in enumerate(raw):
        kind = entry.get("type") if isinstance(entry, dict) else None
        if kind not in (None, "custom"):
            continue  # server tools (web_search_*, bash_*, text_editor_*, ...) run elsewhere
        tool = s.check(s.ToolParam, entry, ("tools", i))
        if any(known.name == tool.name for known in tools):
            raise invalid(
                f"tools.{i}.name: tool names must be unique ({tool.name!r})", f"tools.{i}.name"
            )
        tools.append(
            ToolSpec(tool.name, tool.description or "", tool.input_schema, tool.strict is True)
        )
    return tools


def decode_tool_choice(
    choice: s.ToolChoiceParam | None, tools: list[ToolSpec]
) -> tuple[ToolChoice, bool]:
    if choice is None:
        return ToolChoice(), True
    parallel = not choice.disable_parallel_tool_use
    if choice.type in ("any", "tool") and not tools:
        message = f"tool_choice.type: {choice.type!r} requires at least one custom tool"
        raise invalid(message, "tool_choice.type")
    if choice.type != "tool":
        modes: dict[str, Callable[[], ToolChoice]] = {
            "auto": ToolChoice,
            "any": lambda: ToolChoice("required"),
            "none": lambda: ToolChoice("none"),
        }
        return modes[choice.type](), parallel
    if choice.name is None:
        raise invalid("tool_choice.name: Field required", "tool_choice.name")
    if all(tool.name != choice.name for tool in tools):
        raise invalid(
            f"tool_choice.name: no tool named {choice.name!r} in tools", "tool_choice.name"
        )
    return ToolChoice("function", choice.name), parallel


def decode_sampling(req: s.MessagesBody) -> SamplingParams:
    return sampling_params(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k)


def decode_stop(stops: list[str]) -> list[str]:
    for i, stop in enumerate(stops):
        if not stop:
            raise invalid(
                f"stop_sequences.{i}: stop sequences must not be empty", f"stop_sequences.{i}"
            )
    return list(dict.fromkeys(stops))


def decode_reasoning(
    thinking: s.ThinkingParam | None, output_config: s.OutputConfigParam | None
) -> ReasoningOptions:
    effort = output_config.effort if output_config is not None else None
    options = ReasoningOptions(effort=EFFORTS.get(effort) if isinstance(effort, str) else None)
    if thinking is None:  # not asked for: off, as on the real API
        options.enabled = False
        return options
    options.enabled = thinking.type != "disabled"
    if thinking.type == "enabled":
        budget = thinking.budget_tokens
        if budget is None:
            raise invalid("thinking.budget_tokens: Field required", "thinking.budget_tokens")
        if budget < MIN_THINKING_BUDGET:
            raise invalid(
                f"thinking.budget_tokens: Input should be greater than or equal to {MIN_THINKING_BUDGET}",
                "thinking.budget_tokens",
            )
        if budget > MAX_THINKING_BUDGET:
            raise invalid(
                f"thinking.budget_tokens: Input should be less than or equal to {MAX_THINKING_BUDGET}",
                "thinking.budget_tokens",
            )
        options.budget_tokens = budget
    return options
