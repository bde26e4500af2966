"""Anthropic Messages request decoding: good inputs map exactly, bad inputs name the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pipeserve.api.anthropic_messages.protocol import AnthropicMessages
from pipeserve.api.base import RequestMeta
from pipeserve.errors import ApiError
from pipeserve.request import (
    GenerationRequest,
    Message,
    ReasoningOptions,
    ToolCall,
    ToolChoice,
    ToolSpec,
)

PROTOCOL = AnthropicMessages()
META = RequestMeta(route="/v1/messages", query={"beta": "true"})
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "Weather for a city", "input_schema": SCHEMA}


def body(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model": "m",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
    }
    return {**base, **fields}


def decode(**fields: Any) -> GenerationRequest:
    return PROTOCOL.decode(body(**fields), META)


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def assistant(content: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content}


def test_minimal_request() -> None:
    req = decode()
    assert req.model == "m" and req.max_tokens == 64 and not req.stream
    assert req.messages == [Message("user", "hi")]
    assert req.tools == [] and req.tool_choice == ToolChoice() and req.parallel_tool_calls
    assert req.reasoning == ReasoningOptions(enabled=False) and req.stop == []  # not asked: off
    assert req.show_thinking is False


def test_sampling_and_flags() -> None:
    req = decode(
        temperature=0,
        top_p=0.9,
        top_k=40,
        stream=True,
        stop_sequences=["END", "END", "x"],
        mock_response="ok",
    )
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.top_k) == (0.0, 0.9, 40)
    assert req.stream and req.mock_response == "ok" and req.stop == ["END", "x"]


def test_unknown_fields_are_ignored() -> None:
    extra = {
        "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
        "output_config": {"effort": "medium", "task_budget": 1000},
        "metadata": {"user_id": "u"},
        "service_tier": "auto",
        "container": "c",
        "mcp_servers": [],
        "betas": ["x"],
        "brand_new_field": {"anything": [1, 2]},
    }
    assert decode(**extra).messages == [Message("user", "hi")]


@pytest.mark.parametrize(
    ("system", "expected"),
    [
        ("Be brief.", "Be brief."),
        (
            [
                {"type": "text", "text": "A", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "B"},
            ],
            "A\nB",
        ),
    ],
)
def test_system_string_or_blocks(system: Any, expected: str) -> None:
    assert decode(system=system).messages == [Message("system", expected), Message("user", "hi")]


def test_system_role_message_merges_with_top_level_system() -> None:
    req = decode(system="top", messages=[{"role": "system", "content": "inner"}, user("hi")])
    assert req.messages == [Message("system", "top\n\ninner"), Message("user", "hi")]


def test_system_role_message_mid_conversation_stays_in_place() -> None:
    req = decode(
        messages=[user("a"), assistant("b"), {"role": "system", "content": "note"}, user("c")]
    )
    assert [m.role for m in req.messages] == ["user", "assistant", "system", "user"]


def test_consecutive_same_role_messages_merge() -> None:
    req = decode(
        messages=[
            user("a"),
            user([{"type": "text", "text": "b"}, {"type": "text", "text": "c"}]),
            assistant("x"),
            assistant("y"),
        ]
    )
    assert req.messages == [Message("user", "a\n\nb\nc"), Message("assistant", "x\n\ny")]


def test_tool_round_trip_history() -> None:
    history = [
        user("Weather in Paris?"),
        assistant(
            [
                {"type": "thinking", "thinking": "I should call it.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {
                    "type": "server_tool_use",
                    "id": "srvtoolu_1",
                    "name": "web_search",
                    "input": {"query": "paris"},
                },
                {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
                {"type": "text", "text": "Let me check."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
                {
                    "type": "tool_use",
                    "id": "toolu_2",
                    "name": "get_weather",
                    "input": {"city": "Nice"},
                    "cache_control": {"type": "ephemeral"},
                },
            ]
        ),
        user(
            [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": [{"type": "text", "text": "rain"}],
                    "is_error": False,
                },
                {"type": "text", "text": "And tomorrow?"},
            ]
        ),
    ]
    req = decode(messages=history, tools=[WEATHER])
    calls = [
        ToolCall("toolu_1", "get_weather", '{"city": "Paris"}'),
        ToolCall("toolu_2", "get_weather", '{"city": "Nice"}'),
    ]
    assert req.messages == [
        Message("user", "Weather in Paris?"),
        Message("assistant", "Let me check.", reasoning="I should call it.", tool_calls=calls),
        Message("tool", "sunny", tool_call_id="toolu_1", name="get_weather"),
        Message("tool", "rain", tool_call_id="toolu_2", name="get_weather"),
        Message("user", "And tomorrow?"),
    ]
    assert json.loads(req.messages[1].tool_calls[0].arguments) == {"city": "Paris"}


def test_tool_result_without_text_and_unknown_id() -> None:
    req = decode(
        messages=[user([{"type": "tool_result", "tool_use_id": "toolu_x", "is_error": True}])]
    )
    assert req.messages == [Message("tool", "", tool_call_id="toolu_x")]


def test_documents_and_search_results_become_text() -> None:
    blocks = [
        {
            "type": "document",
            "source": {"type": "text", "media_type": "text/plain", "data": "doc body"},
            "title": "T",
        },
        {
            "type": "document",
            "source": {"type": "content", "content": [{"type": "text", "text": "inner"}]},
        },
        {
            "type": "search_result",
            "source": "https://x",
            "title": "R",
            "content": [{"type": "text", "text": "hit"}],
        },
    ]
    assert decode(messages=[user(blocks)]).messages == [
        Message("user", "T\ndoc body\ninner\nR\nhttps://x\nhit")
    ]


def test_tools_custom_kept_server_tools_skipped() -> None:
    tools = [
        WEATHER,
        {
            "type": "custom",
            "name": "t2",
            "input_schema": {"type": "object"},
            "cache_control": {"type": "ephemeral"},
        },
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        {"type": "bash_20250124", "name": "bash"},
        {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
        {"type": "computer_20250124", "name": "computer", "display_width_px": 1024},
    ]
    req = decode(tools=tools)
    assert req.tools == [
        ToolSpec("get_weather", "Weather for a city", SCHEMA),
        ToolSpec("t2", "", {"type": "object"}),
    ]


@pytest.mark.parametrize(
    ("choice", "expected", "parallel"),
    [
        ({"type": "auto"}, ToolChoice("auto"), True),
        ({"type": "any"}, ToolChoice("required"), True),
        ({"type": "tool", "name": "get_weather"}, ToolChoice("function", "get_weather"), True),
        ({"type": "none"}, ToolChoice("none"), True),
        ({"type": "auto", "disable_parallel_tool_use": True}, ToolChoice("auto"), False),
    ],
)
def test_tool_choice(choice: dict[str, Any], expected: ToolChoice, parallel: bool) -> None:
    req = decode(tools=[WEATHER], tool_choice=choice)
    assert (req.tool_choice, req.parallel_tool_calls) == (expected, parallel)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (
            {"thinking": {"type": "enabled", "budget_tokens": 2048}},
            ReasoningOptions(True, None, 2048),
        ),
        # interleaved thinking: budget may exceed max_tokens (Claude Code relies on it)
        (
            {"thinking": {"type": "enabled", "budget_tokens": 31999}, "max_tokens": 1024},
            ReasoningOptions(True, None, 31999),
        ),
        ({"thinking": {"type": "disabled"}}, ReasoningOptions(False)),
        ({"thinking": {"type": "adaptive"}}, ReasoningOptions(True)),
        (
            {
                "thinking": {"type": "adaptive", "display": "summarized"},
                "output_config": {"effort": "max"},
            },
            ReasoningOptions(True, "high"),
        ),
        ({"output_config": {"effort": "low"}}, ReasoningOptions(False, "low")),
        ({"output_config": {"effort": "ludicrous"}}, ReasoningOptions(False)),
    ],
)
def test_thinking(fields: dict[str, Any], expected: ReasoningOptions) -> None:
    assert decode(**fields).reasoning == expected


def test_count_tokens_body_does_not_need_max_tokens() -> None:
    raw = body()
    del raw["max_tokens"]
    req = PROTOCOL.count_tokens_body(raw, META)
    assert req.max_tokens is None and req.messages == [Message("user", "hi")]
    assert PROTOCOL.count_tokens_response(17) == {"input_tokens": 17}
    with pytest.raises(ApiError) as exc:
        PROTOCOL.decode(raw, META)
    assert exc.value.param == "max_tokens"


TEXT = {"type": "text", "text": "x"}
BAD: list[tuple[Any, str | None, str]] = [
    ([], None, "the request body must be a JSON object"),
    ({"max_tokens": 5, "messages": []}, "model", "model: Field required"),
    ({"model": "m", "messages": []}, "max_tokens", "max_tokens: Field required"),
    ({"model": "m", "max_tokens": 64}, "messages", "messages: Field required"),
    (body(max_tokens=0), "max_tokens", "max_tokens: Input should be greater than or equal to 1"),
    (body(max_tokens="64"), "max_tokens", "max_tokens: Input should be a valid integer"),
    (body(max_tokens=1.5), "max_tokens", "max_tokens: Input should be a valid integer"),
    (body(model=""), "model", "model: String should have at least 1 character"),
    (body(messages=[]), "messages", "messages: at least one message is required"),
    (body(messages="hi"), "messages", "messages: Input should be a valid list"),
    (body(messages=["hi"]), "messages.0", "messages.0: Input should be an object"),
    (
        body(tools=[WEATHER], tool_choice="auto"),
        "tool_choice",
        "tool_choice: Input should be an object",
    ),
    (
        body(messages=[{"role": "bot", "content": "x"}]),
        "messages.0.role",
        "messages.0.role: Input should be 'user', 'assistant' or 'system'",
    ),
    (body(messages=[{"role": "user"}]), "messages.0.content", "messages.0.content: Field required"),
    (
        body(messages=[user(5)]),
        "messages.0.content",
        "messages.0.content: Input should be a valid string or a list of content blocks",
    ),
    (
        body(messages=[user(["x"])]),
        "messages.0.content.0.type",
        "messages.0.content.0.type: each content block must be an object with a string type",
    ),
    (
        body(messages=[user([{"type": "text"}])]),
        "messages.0.content.0.text",
        "messages.0.content.0.text: Field required",
    ),
    (
        body(messages=[user([{"type": "text", "text": 3}])]),
        "messages.0.content.0.text",
        "messages.0.content.0.text: Input should be a valid string",
    ),
    (
        body(
            messages=[
                user(
                    [
                        TEXT,
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                        },
                    ]
                )
            ]
        ),
        "messages.0.content.1",
        "images are not supported by this model",
    ),
    (
        body(
            messages=[
                user(
                    [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t",
                            "content": [{"type": "image", "source": {}}],
                        }
                    ]
                )
            ]
        ),
        "messages.0.content.0.content.0",
        "images are not supported by this model",
    ),
    (
        body(messages=[user([{"type": "tool_use", "id": "t", "name": "n", "input": {}}])]),
        "messages.0.content.0.type",
        "messages.0.content.0.type: content blocks of type 'tool_use' are not supported in user messages",
    ),
    (
        body(messages=[assistant([{"type": "tool_result", "tool_use_id": "t"}])]),
        "messages.0.content.0.type",
        "messages.0.content.0.type: content blocks of type 'tool_result' are not supported in assistant messages",
    ),
    (
        body(messages=[user([{"type": "tool_result"}])]),
        "messages.0.content.0.tool_use_id",
        "messages.0.content.0.tool_use_id: Field required",
    ),
    (
        body(messages=[assistant([{"type": "tool_use", "id": "t", "name": "n", "input": "{}"}])]),
        "messages.0.content.0.input",
        "messages.0.content.0.input: Input should be a valid dictionary",
    ),
    (
        body(messages=[assistant([{"type": "thinking"}])]),
        "messages.0.content.0.thinking",
        "messages.0.content.0.thinking: Field required",
    ),
    (
        body(
            messages=[
                user(
                    [
                        {
                            "type": "document",
                            "source": {
                                "type": "base64",
                                "media_type": "application/pdf",
                                "data": "x",
                            },
                        }
                    ]
                )
            ]
        ),
        "messages.0.content.0.source.type",
        "messages.0.content.0.source.type: only text documents are supported (not 'base64')",
    ),
    (
        body(messages=[user([{"type": "video"}])]),
        "messages.0.content.0.type",
        "messages.0.content.0.type: content blocks of type 'video' are not supported in user messages",
    ),
    (
        body(system=5),
        "system",
        "system: Input should be a valid string or a list of content blocks",
    ),
    (
        body(system=[{"type": "tool_use"}]),
        "system.0.type",
        "system.0.type: content blocks of type 'tool_use' are not supported here",
    ),
    (body(temperature=1.5), "temperature", "temperature: Input should be less than or equal to 1"),
    (body(temperature="hot"), "temperature", "temperature: Input should be a valid number"),
    (body(top_p=-0.1), "top_p", "top_p: Input should be greater than or equal to 0"),
    (body(top_k=-1), "top_k", "top_k: Input should be greater than or equal to 0"),
    (body(stream="yes"), "stream", "stream: Input should be a valid boolean"),
    (body(stop_sequences="END"), "stop_sequences", "stop_sequences: Input should be a valid list"),
    (
        body(stop_sequences=["a", ""]),
        "stop_sequences.1",
        "stop_sequences.1: stop sequences must not be empty",
    ),
    (body(tools=[{"name": "t"}]), "tools.0.input_schema", "tools.0.input_schema: Field required"),
    (
        body(tools=[{"name": "", "input_schema": {}}]),
        "tools.0.name",
        "tools.0.name: String should have at least 1 character",
    ),
    (body(tools=["t"]), "tools.0", "tools.0: Input should be an object"),
    (
        body(tools=[WEATHER, WEATHER]),
        "tools.1.name",
        "tools.1.name: tool names must be unique ('get_weather')",
    ),
    (
        body(tools=[WEATHER], tool_choice={"type": "tool"}),
        "tool_choice.name",
        "tool_choice.name: Field required",
    ),
    (
        body(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}),
        "tool_choice.name",
        "tool_choice.name: no tool named 'nope' in tools",
    ),
    (
        body(tool_choice={"type": "any"}),
        "tool_choice.type",
        "tool_choice.type: 'any' requires at least one custom tool",
    ),
    (
        body(tools=[WEATHER], tool_choice={"type": "sometimes"}),
        "tool_choice.type",
        "tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'",
    ),
    (
        body(thinking={"type": "enabled"}),
        "thinking.budget_tokens",
        "thinking.budget_tokens: Field required",
    ),
    (
        body(thinking={"type": "enabled", "budget_tokens": 512}),
        "thinking.budget_tokens",
        "thinking.budget_tokens: Input should be greater than or equal to 1024",
    ),
    (
        body(thinking={"type": "maybe"}),
        "thinking.type",
        "thinking.type: Input should be 'enabled', 'disabled', 'adaptive' or 'between_tools'",
    ),
    (body(mock_response=1), "mock_response", "mock_response: Input should be a valid string"),
]


@pytest.mark.parametrize(("raw", "param", "message"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input(raw: Any, param: str | None, message: str) -> None:
    with pytest.raises(ApiError) as exc:
        PROTOCOL.decode(raw, META)
    assert (exc.value.kind, exc.value.param, exc.value.message) == (
        "invalid_request",
        param,
        message,
    )
    assert PROTOCOL.error_status(exc.value) == 400
    assert PROTOCOL.error_body(exc.value) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": message},
    }


def test_null_for_optional_fields_means_absent() -> None:
    """Some clients (proxies, SDKs in other languages) send null for unset optional fields."""
    nulls = dict.fromkeys(
        [
            "system",
            "tools",
            "tool_choice",
            "thinking",
            "stop_sequences",
            "temperature",
            "top_p",
            "top_k",
            "stream",
            "metadata",
            "output_config",
            "mock_response",
        ]
    )
    req = decode(**nulls)
    assert (
        not req.stream
        and req.stop == []
        and req.tools == []
        and req.messages == [Message("user", "hi")]
    )
    history = [
        assistant(
            [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "x"}}]
        ),
        user(
            [
                {
                    "type": "tool_result",
                    "tool_use_id": "t1",
                    "content": "sunny",
                    "is_error": None,
                    "cache_control": None,
                }
            ]
        ),
    ]
    choice = {"type": "auto", "disable_parallel_tool_use": None}
    req = decode(messages=history, tools=[{**WEATHER, "description": None}], tool_choice=choice)
    assert req.messages[-1].content == "sunny" and req.parallel_tool_calls
