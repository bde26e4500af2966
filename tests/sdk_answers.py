"""What an official SDK client reads from one answer (reasoning, text, tool calls, how it
ended), collected the same way for every test that compares protocols: Chat Completions,
Responses and Messages, streaming (the SDK's own stream helper) or not."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from anthropic import Anthropic
from openai import OpenAI


@dataclass
class Answer:
    reasoning: str = ""
    text: str = ""
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    finish: str = ""  # the protocol's own word: finish_reason, status or stop_reason


def chat_answer(client: OpenAI, kw: dict[str, Any], stream: bool) -> Answer:
    if stream:
        with client.chat.completions.stream(**kw) as events:
            reasoning = "".join(
                getattr(e.chunk.choices[0].delta, "reasoning_content", None) or ""
                for e in events
                if e.type == "chunk" and e.chunk.choices
            )
            completion = events.get_final_completion()
    else:
        completion = client.chat.completions.create(**kw)
        reasoning = getattr(completion.choices[0].message, "reasoning_content", None) or ""
    choice = completion.choices[0]
    calls = [
        (c.function.name, json.loads(c.function.arguments))  # type: ignore[union-attr]
        for c in choice.message.tool_calls or []
    ]
    assert all(c.id.startswith("call_") for c in choice.message.tool_calls or [])
    return Answer(reasoning, choice.message.content or "", calls, choice.finish_reason)


def responses_answer(client: OpenAI, kw: dict[str, Any], stream: bool) -> Answer:
    if stream:
        with client.responses.stream(**kw) as events:
            numbers = [event.sequence_number for event in events]
            response = events.get_final_response()
        assert numbers == list(range(len(numbers)))
    else:
        response = client.responses.create(**kw)
    answer = Answer(finish=response.status or "")
    for item in response.output:
        if item.type == "reasoning":
            answer.reasoning += "".join(part.text for part in item.content or [])
        elif item.type == "message":
            answer.text += "".join(getattr(part, "text", "") for part in item.content)
        elif item.type == "function_call":
            assert item.status == "completed" and item.call_id.startswith("call_")
            answer.calls.append((item.name, json.loads(item.arguments)))
    return answer


def messages_answer(client: Anthropic, kw: dict[str, Any], stream: bool) -> Answer:
    if stream:
        with client.messages.stream(**kw) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**kw)
    answer = Answer(finish=message.stop_reason or "")
    for block in message.content:
        if block.type == "thinking":
            assert block.signature
            answer.reasoning += block.thinking
        elif block.type == "text":
            answer.text += block.text
        elif block.type == "tool_use":
            assert block.id.startswith("toolu_")
            answer.calls.append((block.name, dict(block.input)))  # type: ignore[call-overload]
    return answer
