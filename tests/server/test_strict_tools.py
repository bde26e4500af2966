"""Strict tools under tool_choice auto on the demo server (qwen3 demo, random weights),
through each protocol's own SDK: Chat calls sampled at temperature 1.0 validate against
the strict tool's schema; Chat / Anthropic `strict: true` and Responses function tools
(strict unless `strict: false`, the Responses default) reach the grammar, so a schema
that cannot compile is a 400 naming the tool, in the protocol's own error shape.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from anthropic import Anthropic
from openai import OpenAI

from tests.server.structured_cases import sample_all, wait_idle

pytestmark = [pytest.mark.server, pytest.mark.mlx]

ARGS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
BROKEN: dict[str, Any] = {"type": "object", "properties": {"city": {"type": "strin"}}}
TOOL_CALL = 151657  # <tool_call> in the qwen3 vocabulary (biased: a random model calls)
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def client(demo_server: str) -> OpenAI:
    return OpenAI(base_url=f"{demo_server}/v1", api_key="test", max_retries=0, timeout=300)


def chat_tool(schema: dict[str, Any], strict: bool | None) -> dict[str, Any]:
    function = {"name": "weather", "parameters": schema}
    if strict is not None:
        function["strict"] = strict
    return {"type": "function", "function": function}


def test_chat_strict_calls_under_auto_validate(client: OpenAI) -> None:
    def ask(_: int) -> list[Any]:
        reply = client.chat.completions.create(
            model="demo", messages=ASK, tools=[chat_tool(ARGS, True)], tool_choice="auto",
            temperature=1.0, max_tokens=64, logit_bias={str(TOOL_CALL): 30},
            reasoning_effort="none",
        )  # fmt: skip
        return reply.choices[0].message.tool_calls or []

    calls = [call for answer in sample_all(ask, 4) for call in answer]
    assert calls  # without the grammar a random model's call is unreadable text
    for call in calls:
        assert call.function.name == "weather"
        jsonschema.validate(json.loads(call.function.arguments), ARGS)


def test_chat_strict_schema_that_cannot_compile_is_a_400(client: OpenAI, demo_server: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="demo", messages=ASK, tools=[chat_tool(BROKEN, True)], max_tokens=4
        )
    body: Any = info.value.body
    assert body["param"] == "tools"
    assert "'weather'" in body["message"] and "strin" in body["message"]
    for strict in (False, None):  # not strict: the schema is never compiled
        reply = client.chat.completions.create(
            model="demo", messages=ASK, tools=[chat_tool(BROKEN, strict)], max_tokens=4
        )
        assert reply.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert wait_idle(demo_server) == 0


def test_responses_function_tools_are_strict_by_default(client: OpenAI) -> None:
    tool: dict[str, Any] = {"type": "function", "name": "weather", "parameters": BROKEN}
    for sent in ({}, {"strict": None}, {"strict": True}):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(
                model="demo", input="Weather?", tools=[{**tool, **sent}], max_output_tokens=16
            )
        assert "'weather'" in str(info.value.body)
    reply = client.responses.create(
        model="demo", input="Weather?", tools=[{**tool, "strict": False}], max_output_tokens=16
    )
    assert reply.status in ("completed", "incomplete")
    # A schema that compiles: answers are text or calls whose arguments validate.
    good = {**tool, "parameters": ARGS}
    reply = client.responses.create(
        model="demo", input="Weather?", tools=[good], max_output_tokens=48, temperature=1.0
    )
    for item in reply.output:
        if item.type == "function_call":
            jsonschema.validate(json.loads(item.arguments), ARGS)


def test_anthropic_strict_tool_reaches_the_grammar(demo_server: str) -> None:
    client = Anthropic(base_url=demo_server, api_key="test", max_retries=0, timeout=300)
    tool: dict[str, Any] = {"name": "weather", "input_schema": BROKEN, "strict": True}
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            model="demo",
            max_tokens=16,
            messages=ASK,
            tools=[tool],  # type: ignore[list-item]
        )
    body: Any = info.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "'weather'" in body["error"]["message"]
    loose = {**tool, "strict": False}
    reply = client.messages.create(
        model="demo",
        max_tokens=16,
        messages=ASK,
        tools=[loose],  # type: ignore[list-item]
    )
    assert reply.stop_reason in ("max_tokens", "end_turn", "tool_use")


def test_chat_response_format_with_tools_answers_or_calls(client: OpenAI) -> None:
    """response_format and tools together (an agent with a typed final answer): each
    reply is an answer in the format or calls with valid arguments, never free text."""
    answer = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "final", "schema": answer}}

    def ask(i: int) -> Any:
        bias = {str(TOOL_CALL): 30} if i % 2 else {}  # odd: make the call likely
        reply = client.chat.completions.create(
            model="demo", messages=ASK, tools=[chat_tool(ARGS, i < 4)], response_format=fmt,
            temperature=1.0, max_tokens=48, logit_bias=bias, reasoning_effort="none",
        )  # fmt: skip
        return reply.choices[0]

    choices = sample_all(ask, 8)
    calls, answers = [], []
    for i, choice in enumerate(choices):
        done = choice.finish_reason != "length"  # else the last call or the answer is cut
        made = list(choice.message.tool_calls or [])[: None if done else -1]
        calls += [(i < 4, json.loads(call.function.arguments)) for call in made]
        if not choice.message.tool_calls and done:
            answers.append(json.loads(choice.message.content or ""))
    assert calls and answers, choices
    for strict, arguments in calls:  # the tool is strict in the first four requests
        assert isinstance(arguments, dict)
        if strict:
            jsonschema.validate(arguments, ARGS)
    for value in answers:
        jsonschema.validate(value, answer)
