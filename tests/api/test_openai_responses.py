"""OpenAI Responses: decode tables (incl. a Codex CLI request), encoders checked with the SDK."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.responses import Response, ResponseErrorEvent, ResponseStreamEvent
from pydantic import TypeAdapter

from pipeserve.api import load_builtin_protocols
from pipeserve.api.base import RequestMeta
from pipeserve.api.openai_responses.protocol import OpenAIResponses
from pipeserve.errors import ApiError
from pipeserve.events import (
    ContentDelta,
    ErrorEvent,
    Event,
    Finish,
    KeepAlive,
    PromptReady,
    ReasoningDelta,
    TokenText,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from pipeserve.request import GenerationRequest
from pipeserve.server.generation import closing_stream
from pipeserve.stages.base import RequestContext
from pipeserve.store import SqliteStore
from tests.api.helpers import (
    QWEN3_PIECES,
    QWEN3_WEATHER_PARAMS,
    Harness,
    ctx_for,
    data_frames,
    final_via_sdk,
    scripted_pipeline,
)

PROTOCOL = OpenAIResponses()
META = RequestMeta(route="/v1/responses")
EVENT_ADAPTER: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
    "strict": False,
}
BASE_PROMPT = "You are Codex, a coding agent. " * 700  # ~20 KB, like the real one

# Shaped like the body Codex CLI 0.171 sends (docs/architecture.md, "Protocols"), second
# turn of a session.
CODEX_REQUEST: dict[str, Any] = {
    "model": "demo",
    "input": [
        {
            "type": "message",
            "role": "developer",
            "content": [{"type": "input_text", "text": BASE_PROMPT}],
        },
        {
            "type": "message",
            "role": "user",
            "id": "msg_env",
            "content": [
                {"type": "input_text", "text": "<environment_context>cwd=/w</environment_context>"}
            ],
        },
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "list the files"}],
        },
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [{"type": "summary_text", "text": "Plan: run ls"}],
            "content": [{"type": "reasoning_text", "text": "I should run ls."}],
            "encrypted_content": None,
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_1",
            "name": "shell",
            "arguments": '{"command":["ls"]}',
            "status": "completed",
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "a.txt\nb.txt"},
        {
            "type": "function_call",
            "id": "fc_2",
            "call_id": "call_2",
            "name": "read",
            "namespace": "mcp__files__",
            "arguments": '{"path":"a.txt"}',
        },
        {
            "type": "function_call_output",
            "call_id": "call_2",
            "output": [{"type": "input_text", "text": "hello"}],
        },
        {
            "type": "custom_tool_call",
            "id": "ctc_1",
            "call_id": "call_3",
            "name": "apply_patch",
            "input": "*** Begin Patch",
        },
        {"type": "custom_tool_call_output", "call_id": "call_3", "output": "Done"},
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "content": [{"type": "output_text", "text": "Two files.", "annotations": []}],
        },
        {
            "type": "web_search_call",
            "id": "ws_1",
            "status": "completed",
            "action": {"type": "search", "query": "x"},
        },
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "thanks"}]},
    ],
    "tools": [
        {
            "type": "function",
            "name": "shell",
            "description": "Runs a shell command",
            "strict": False,
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "array", "items": {"type": "string"}}},
            },
        },
        {
            "type": "namespace",
            "name": "mcp__files__",
            "description": "File tools",
            "tools": [
                {
                    "type": "function",
                    "name": "read",
                    "description": "Read a file",
                    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
                },
                {"type": "custom", "name": "scribble"},
            ],
        },
        {
            "type": "custom",
            "name": "apply_patch",
            "description": "Patch files",
            "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
        },
        {"type": "tool_search", "description": "Find more tools"},
        {"type": "web_search", "external_web_access": False},
        {"type": "file_search", "vector_store_ids": ["vs_1"]},
    ],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "reasoning": {"effort": "medium", "summary": "auto"},
    "store": False,
    "stream": True,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "0199a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b",
    "client_metadata": {"originator": "codex_cli_rs", "session": "abc"},
    "text": {"verbosity": "medium"},
    "service_tier": "auto",
}


def decode(**body: Any) -> GenerationRequest:
    return PROTOCOL.decode({"model": "demo", "input": "hi", **body}, META)


def test_registered_under_its_name() -> None:
    assert load_builtin_protocols()["openai-responses"] is OpenAIResponses


# ---------------------------------------------------------------- decode


def test_decode_codex_request() -> None:
    req = PROTOCOL.decode(CODEX_REQUEST, META)
    roles = [m.role for m in req.messages]
    assert roles == ["system", "user", "user"] + ["assistant", "tool"] * 3 + ["assistant", "user"]
    assert req.messages[0].content == BASE_PROMPT
    assert (
        req.messages[3].reasoning == "I should run ls."
    )  # reasoning content preferred over summary
    calls = [m.tool_calls[0] for m in req.messages[3:9:2]]
    assert [(c.id, c.name) for c in calls] == [
        ("call_1", "shell"),
        ("call_2", "mcp__files__.read"),
        ("call_3", "apply_patch"),
    ]
    assert calls[2].arguments == '{"input": "*** Begin Patch"}'
    tools_out = req.messages[4:10:2]
    assert [(m.tool_call_id, m.name, m.content) for m in tools_out] == [
        ("call_1", "shell", "a.txt\nb.txt"),
        ("call_2", "mcp__files__.read", "hello"),
        ("call_3", "apply_patch", "Done"),
    ]
    assert req.messages[9].content == "Two files." and req.messages[10].content == "thanks"
    assert [t.name for t in req.tools] == ["shell", "mcp__files__.read"]
    assert req.tool_choice.mode == "auto" and req.parallel_tool_calls is False
    assert req.reasoning.effort == "medium" and req.stream and not req.logprobs


def test_decode_instructions_and_string_input() -> None:
    req = decode(
        instructions="Be brief.",
        max_output_tokens=64,
        temperature=0.3,
        top_p=0.5,
        reasoning={"effort": "none"},
    )
    assert [(m.role, m.content) for m in req.messages] == [("system", "Be brief."), ("user", "hi")]
    assert req.max_tokens == 64 and (req.sampling.temperature, req.sampling.top_p) == (0.3, 0.5)
    assert req.reasoning.enabled is False


def test_decode_instructions_merge_with_leading_developer() -> None:
    req = decode(
        instructions="A",
        input=[{"role": "developer", "content": "B"}, {"role": "user", "content": "C"}],
    )
    assert [(m.role, m.content) for m in req.messages] == [("system", "A\n\nB"), ("user", "C")]


@pytest.mark.parametrize(
    ("body", "check"),
    [
        ({"input": [{"role": "user", "content": "x"}]}, lambda r: r.messages[0].content == "x"),
        (
            {
                "input": [
                    {
                        "type": "message",
                        "role": "system",
                        "content": [{"type": "input_text", "text": "s"}],
                    },
                    {"role": "user", "content": "u"},
                ]
            },
            lambda r: [m.role for m in r.messages] == ["system", "user"],
        ),
        (
            {
                "input": [
                    {"role": "user", "content": "q"},
                    {"type": "reasoning", "summary": [{"type": "summary_text", "text": "S"}]},
                    {"role": "assistant", "content": "A"},
                ]
            },
            lambda r: r.messages[1].reasoning == "S",
        ),
        (
            {
                "input": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "A"},
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                ]
            },
            lambda r: (
                len(r.messages) == 2
                and r.messages[1].content == "A"
                and r.messages[1].tool_calls[0].id == "c"
            ),
        ),
        (
            {
                "input": [
                    {"role": "user", "content": "q"},
                    {"type": "function_call_output", "call_id": "zz", "output": {"ok": True}},
                ]
            },
            lambda r: r.messages[1].content == '{"ok": true}' and r.messages[1].name is None,
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}},
            lambda r: (r.tool_choice.mode, r.tool_choice.name) == ("function", "get_weather"),
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required"},
            lambda r: r.tool_choice.mode == "required",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": {
                    "type": "allowed_tools",
                    "mode": "required",
                    "tools": [{"type": "function", "name": "get_weather"}],
                },
            },
            lambda r: r.tool_choice.mode == "required",
        ),
        (
            {"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}},
            lambda r: r.tool_choice.mode == "auto",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "chat_shape"}}]},
            lambda r: r.tools[0].name == "chat_shape",
        ),
        ({"tools": [{"name": "untyped"}]}, lambda r: r.tools[0].name == "untyped"),
        (
            {"include": ["message.output_text.logprobs"], "top_logprobs": 2},
            lambda r: (r.logprobs, r.top_logprobs) == (True, 2),
        ),
        (
            {"reasoning": {"effort": "xhigh", "summary": "detailed"}},
            lambda r: r.reasoning.effort == "high",
        ),
        (
            {"text": {"format": {"type": "text"}, "verbosity": "low"}},
            lambda r: r.messages[0].content == "hi",
        ),
        ({"mock_response": "canned"}, lambda r: r.mock_response == "canned"),
        (
            {"metadata": {"a": "b"}, "user": "u", "store": True, "truncation": "auto"},
            lambda r: True,
        ),
    ],
)
def test_decode_variants(body: dict[str, Any], check: Any) -> None:
    assert check(decode(**body))


BAD_REQUESTS: list[tuple[Any, str | None]] = [
    ([], None),
    ("hi", None),
    ({"input": "hi"}, "model"),
    ({"model": "demo"}, "input"),
    ({"model": "demo", "input": 5}, "input"),
    ({"model": "demo", "input": []}, "input"),
    ({"model": "demo", "input": ["x"]}, "input[0]"),
    ({"model": "demo", "input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"model": "demo", "input": [{"role": "user"}]}, "input[0].content"),
    (
        {"model": "demo", "input": [{"role": "user", "content": [{"type": "input_text"}]}]},
        "input[0].content[0].text",
    ),
    (
        {"model": "demo", "input": [{"role": "user", "content": [{"type": "mystery"}]}]},
        "input[0].content[0].type",
    ),
    (
        {"model": "demo", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
        "input[0].call_id",
    ),
    (
        {"model": "demo", "input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]},
        "input[0].name",
    ),
    (
        {"model": "demo", "input": [{"type": "function_call_output", "output": "x"}]},
        "input[0].call_id",
    ),
    ({"model": "demo", "input": [{"type": "reasoning", "summary": "text"}]}, "input[0].summary"),
    ({"model": "demo", "input": "hi", "instructions": 3}, "instructions"),
    ({"model": "demo", "input": "hi", "temperature": 9}, "temperature"),
    ({"model": "demo", "input": "hi", "top_p": -0.1}, "top_p"),
    ({"model": "demo", "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "demo", "input": "hi", "max_output_tokens": "10"}, "max_output_tokens"),
    ({"model": "demo", "input": "hi", "top_logprobs": 25}, "top_logprobs"),
    ({"model": "demo", "input": "hi", "stream": 1}, "stream"),
    ({"model": "demo", "input": "hi", "reasoning": {"effort": "maximal"}}, "reasoning.effort"),
    ({"model": "demo", "input": "hi", "reasoning": "high"}, "reasoning"),
    ({"model": "demo", "input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"model": "demo", "input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"model": "demo", "input": "hi", "background": True}, "background"),
    ({"model": "demo", "input": "hi", "tools": "all"}, "tools"),
    ({"model": "demo", "input": "hi", "tools": [{"type": "function"}]}, "tools[0].name"),
    (
        {
            "model": "demo",
            "input": "hi",
            "tools": [{"type": "function", "name": "f", "parameters": []}],
        },
        "tools[0].parameters",
    ),
    (
        {"model": "demo", "input": "hi", "tools": [{"type": "namespace", "tools": []}]},
        "tools[0].name",
    ),
    ({"model": "demo", "input": "hi", "tools": [WEATHER], "tool_choice": "maybe"}, "tool_choice"),
    (
        {"model": "demo", "input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function"}},
        "tool_choice.name",
    ),
    (
        {
            "model": "demo",
            "input": "hi",
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "nope"},
        },
        "tool_choice",
    ),
    ({"model": "demo", "input": "hi", "tool_choice": "required"}, "tool_choice"),
]


@pytest.mark.parametrize(("body", "param"), BAD_REQUESTS)
def test_decode_rejects_with_param(body: Any, param: str | None) -> None:
    with pytest.raises(ApiError) as info:
        PROTOCOL.decode(body, META)
    err = info.value
    assert err.kind == "invalid_request" and PROTOCOL.error_status(err) == 400
    assert err.param == param
    if param:
        assert param in err.message
    assert PROTOCOL.error_body(err)["error"]["param"] == param


@pytest.mark.parametrize(
    ("content", "param"),
    [
        ([{"type": "input_image", "image_url": "data:,"}], "input[0].content[0]"),
        (
            [{"type": "input_text", "text": "x"}, {"type": "input_file", "file_id": "f"}],
            "input[0].content[1]",
        ),
    ],
)
def test_images_are_a_clear_400(content: Any, param: str) -> None:
    with pytest.raises(ApiError) as info:
        decode(input=[{"role": "user", "content": content}])
    assert info.value.param == param and "images are not supported" in info.value.message


@pytest.mark.parametrize("stored", [False, True])
@pytest.mark.parametrize("value", [5, True, 1.5, {"role": "user", "content": "hi"}])
def test_input_of_another_type_is_a_400(tmp_path: Path, stored: bool, value: Any) -> None:
    protocol = OpenAIResponses()
    if stored:  # the store reads the input as items before the messages are built
        protocol.use_store(SqliteStore(tmp_path / "responses.sqlite3", 30, 1 << 20, 1.0))
    with pytest.raises(ApiError) as info:
        protocol.decode({"model": "demo", "input": value}, META)
    assert info.value.param == "input" and protocol.error_status(info.value) == 400


# ---------------------------------------------------------------- encode

TEXT_RUN: list[Event] = [
    PromptReady(9, 2),
    ContentDelta("Hello"),
    ContentDelta(" there"),
    Finish("stop"),
    Usage(9, 2, 2),
]
FULL_RUN: list[Event] = [
    PromptReady(50),
    KeepAlive(),
    ReasoningDelta("The user wants "),
    ReasoningDelta("weather."),
    ContentDelta("Checking."),
    ToolCallStart(0, "call_w1", "get_weather"),
    ToolCallArgsDelta(0, '{"city": '),
    ToolCallArgsDelta(0, '"Oslo"}'),
    ToolCallEnd(0, '{"city": "Oslo"}'),
    ToolCallStart(1, "call_w2", "mcp__files__.read"),
    ToolCallEnd(1, '{"path": "a"}'),
    Finish("tool_calls"),
    Usage(50, 30, 10, 5),
]


def encode_json(events: list[Event], **body: Any) -> dict[str, Any]:
    req = decode(**body)
    return PROTOCOL.encode_json(iter(events), ctx_for(req))


def test_json_text_response() -> None:
    body = encode_json(
        TEXT_RUN, instructions="Be nice", tools=[WEATHER, {"type": "web_search"}], temperature=0.5
    )
    response = Response.model_validate(body)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "completed" and response.model == "demo"
    assert response.output_text == "Hello there"
    (message,) = response.output
    assert (
        message.type == "message"
        and message.id.startswith("msg_")
        and message.status == "completed"
    )
    assert response.usage and (
        response.usage.input_tokens,
        response.usage.output_tokens,
        response.usage.total_tokens,
    ) == (9, 2, 11)
    assert response.usage.input_tokens_details.cached_tokens == 2
    assert (response.instructions, response.temperature, response.tool_choice) == (
        "Be nice",
        0.5,
        "auto",
    )
    assert [t.type for t in response.tools] == ["function", "web_search"]


def test_json_reasoning_message_and_calls_in_order() -> None:
    body = encode_json(FULL_RUN, tools=[WEATHER])
    response = Response.model_validate(body)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message", "function_call", "function_call"]
    reasoning, message, call1, call2 = response.output
    assert (
        reasoning.id.startswith("rs_")
        and reasoning.content
        and reasoning.content[0].text == "The user wants weather."
    )
    assert reasoning.summary == []
    assert message.content[0].text == "Checking."  # type: ignore[union-attr]
    assert call1.id and call1.id.startswith("fc_") and call1.call_id == "call_w1"  # type: ignore[union-attr]
    assert (call1.name, call1.arguments, call1.status) == (
        "get_weather",
        '{"city": "Oslo"}',
        "completed",
    )  # type: ignore[union-attr]
    assert (call2.namespace, call2.name, call2.arguments) == (
        "mcp__files__",
        "read",
        '{"path": "a"}',
    )  # type: ignore[union-attr]
    assert response.usage and response.usage.output_tokens_details.reasoning_tokens == 5


def test_json_length_is_incomplete() -> None:
    body = encode_json([ContentDelta("cut"), Finish("length"), Usage(3, 16)], max_output_tokens=16)
    response = Response.model_validate(body)
    assert response.status == "incomplete" and response.incomplete_details
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"  # type: ignore[union-attr]
    assert response.max_output_tokens == 16


def test_json_logprobs_from_the_context_records() -> None:
    req = decode(include=["message.output_text.logprobs"], top_logprobs=0)
    ctx = ctx_for(req)

    def run() -> Any:
        records = ctx.logprob_records
        records.append(TokenText("Hi", 1, -0.5))
        yield ContentDelta("Hi")
        yield Finish("stop")
        yield Usage(1, 1)

    body = PROTOCOL.encode_json(run(), ctx)
    part = Response.model_validate(body).output[0].content[0]  # type: ignore[union-attr]
    assert [(lp.token, lp.logprob, lp.bytes) for lp in part.logprobs] == [("Hi", -0.5, [72, 105])]


@pytest.mark.parametrize(
    ("events", "kind"),
    [
        ([ErrorEvent("internal", "engine fault"), Finish("error"), Usage(1, 0)], "internal"),
        ([ContentDelta("x"), Finish("cancelled"), Usage(1, 1)], "internal"),
        ([ContentDelta("x")], "internal"),  # no Finish at all
    ],
)
def test_json_failures_raise(events: list[Event], kind: str) -> None:
    with pytest.raises(ApiError) as info:
        encode_json(events)
    assert info.value.kind == kind


def stream_raw(events: list[Event], **body: Any) -> bytes:
    req = decode(stream=True, **body)
    return b"".join(PROTOCOL.encode_stream(iter(events), ctx_for(req)))


def test_stream_event_grammar() -> None:
    raw = stream_raw(FULL_RUN, tools=[WEATHER])
    assert b": keep-alive\n\n" in raw
    events = data_frames(raw)
    for event in events:
        EVENT_ADAPTER.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    assert (
        types[:2] == ["response.created", "response.in_progress"]
        and types[-1] == "response.completed"
    )
    assert (
        events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    )
    # items strictly sequential: each added item is done before the next one is added
    open_index = None
    for event in events:
        if event["type"] == "response.output_item.added":
            assert open_index is None
            open_index = event["output_index"]
        elif event["type"] == "response.output_item.done":
            assert event["output_index"] == open_index
            open_index = None
        elif "output_index" in event:
            assert event["output_index"] == open_index
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call", "function_call"]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [
        0,
        1,
        2,
        3,
    ]
    assert "response.reasoning_text.delta" in types and "response.output_text.delta" in types
    args = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert args == ['{"city": ', '"Oslo"}', '{"path": "a"}']
    done_items = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert (
        done_items[1]["content"][0]["text"] == "Checking."
        and done_items[1]["status"] == "completed"
    )
    assert done_items[2]["id"].startswith("fc_") and done_items[2]["call_id"] == "call_w1"
    assert events[-1]["response"]["output"] == done_items


def _strip(value: Any) -> Any:
    """Drop random ids and the SDK's parse-helper keys, to compare two runs."""
    if isinstance(value, dict):
        return {
            k: _strip(v) for k, v in value.items() if k not in ("id", "parsed", "parsed_arguments")
        }
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def test_stream_sdk_accumulator_matches_json() -> None:
    final = final_via_sdk(stream_raw(FULL_RUN, tools=[WEATHER]), tools=[WEATHER])
    body = Response.model_validate(encode_json(FULL_RUN, tools=[WEATHER]))
    assert final.output_text == body.output_text == "Checking."
    assert _strip([i.model_dump() for i in final.output]) == _strip(
        [i.model_dump() for i in body.output]
    )
    assert final.usage == body.usage


def test_stream_length_ends_incomplete() -> None:
    events = data_frames(stream_raw([ContentDelta("cut"), Finish("length"), Usage(3, 16)]))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    EVENT_ADAPTER.validate_python(events[-1])


def test_stream_failure_ends_with_response_failed() -> None:
    raw = stream_raw(
        [
            ReasoningDelta("hmm"),
            ContentDelta("part"),
            ErrorEvent("internal", "engine fault"),
            Finish("error"),
            Usage(1, 1),
        ]
    )
    events = data_frames(raw)
    for event in events:
        EVENT_ADAPTER.validate_python(event)
    types = [e["type"] for e in events]
    assert types[-1] == "response.failed" and "response.completed" not in types
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {
        "code": "server_error",
        "message": "engine fault",
    }
    assert [i["type"] for i in failed["output"]] == ["reasoning", "message"]
    assert failed["output"][1]["status"] == "incomplete"
    with pytest.raises(RuntimeError, match="response.completed"):
        final_via_sdk(raw)


def test_stream_cancel_is_failed() -> None:
    events = data_frames(stream_raw([ContentDelta("a"), Finish("cancelled"), Usage(1, 1)]))
    assert events[-1]["type"] == "response.failed"


# ---------------------------------------------------------------- the official SDK end to end (in process)


def weather_script(ctx: RequestContext) -> list[Event]:
    last = ctx.request.messages[-1]
    if last.role == "tool":
        return [
            PromptReady(40),
            ReasoningDelta("Got it."),
            ContentDelta(f"It is {last.content}."),
            Finish("stop"),
            Usage(40, 9),
        ]
    return [
        PromptReady(30),
        ReasoningDelta("Use the tool."),
        *FULL_RUN[5:9],
        Finish("tool_calls"),
        Usage(30, 12),
    ]


def test_sdk_create_and_stream() -> None:
    client = Harness(PROTOCOL, lambda ctx: list(TEXT_RUN)).client
    assert client.responses.create(model="demo", input="hi").output_text == "Hello there"
    events = list(client.responses.create(model="demo", input="hi", stream=True))
    assert events[-1].type == "response.completed"
    with client.responses.stream(model="demo", input="hi") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "Hello there"


def test_sdk_tool_round_trip() -> None:
    harness = Harness(PROTOCOL, weather_script)
    client = harness.client
    tools: Any = [WEATHER]
    with client.responses.stream(model="demo", input="Weather in Oslo?", tools=tools) as stream:
        first = stream.get_final_response()
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    history: list[Any] = [{"role": "user", "content": "Weather in Oslo?"}]
    history += [item.model_dump(exclude_none=True) for item in first.output]
    history.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"})
    answer = client.responses.create(model="demo", input=history, tools=tools)
    assert answer.output_text == "It is sunny."
    replayed = harness.requests[-1].messages
    assert [m.role for m in replayed] == ["user", "assistant", "tool"]
    assert (
        replayed[1].reasoning == "Use the tool."
        and replayed[1].tool_calls[0].id == calls[0].call_id
    )
    assert replayed[2].name == "get_weather"


def test_sdk_codex_request_streams() -> None:
    harness = Harness(PROTOCOL, lambda ctx: list(FULL_RUN))
    known = (
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "reasoning",
        "store",
        "include",
        "prompt_cache_key",
        "text",
    )
    body = {k: CODEX_REQUEST[k] for k in known}
    extra = {"client_metadata": CODEX_REQUEST["client_metadata"], "service_tier": "auto"}
    with harness.client.responses.stream(
        model="demo", input=CODEX_REQUEST["input"], extra_body=extra, **body
    ) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "Checking."
    assert [t.type for t in final.tools][:3] == ["function", "namespace", "custom"]


def test_sdk_errors() -> None:
    client = Harness(
        PROTOCOL, lambda ctx: [ErrorEvent("internal", "boom"), Finish("error"), Usage(1, 0)]
    ).client
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="demo", input="hi", previous_response_id="resp_x")
    assert info.value.param == "previous_response_id"
    with pytest.raises(openai.InternalServerError):
        client.responses.create(model="demo", input="hi")


def test_sealed_reasoning_round_trip() -> None:
    """include=reasoning.encrypted_content: a stateless client gets the reasoning back next turn."""
    body = encode_json(FULL_RUN, include=["reasoning.encrypted_content"])
    reasoning = Response.model_validate(body).output[0]
    assert reasoning.type == "reasoning" and reasoning.encrypted_content
    echoed = {
        "type": "reasoning",
        "id": reasoning.id,
        "summary": [],
        "encrypted_content": reasoning.encrypted_content,
    }
    req = decode(
        input=[{"role": "user", "content": "q"}, echoed, {"role": "assistant", "content": "A"}]
    )
    assert req.messages[1].reasoning == "The user wants weather."
    assert "encrypted_content" not in encode_json(FULL_RUN)["output"][0]


def test_foreign_encrypted_reasoning_is_ignored() -> None:
    item = {
        "type": "reasoning",
        "summary": [{"type": "summary_text", "text": "S"}],
        "encrypted_content": "gAAAAB...",
    }
    req = decode(
        input=[{"role": "user", "content": "q"}, item, {"role": "assistant", "content": "A"}]
    )
    assert req.messages[1].reasoning == "S"


def test_empty_generation_still_has_a_message_item() -> None:
    events = data_frames(stream_raw([PromptReady(3), Finish("stop"), Usage(3, 1)]))
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["type"], i["content"][0]["text"]) for i in done] == [("message", "")]
    assert events[-1]["type"] == "response.completed"


@pytest.mark.parametrize("reason", ["stop", "length"])
def test_broken_call_item_is_incomplete(reason: Any) -> None:
    events = [
        ToolCallStart(0, "call_b", "get_weather"),
        ToolCallArgsDelta(0, '{"city": "Pa'),
        ToolCallEnd(0, '{"city": "Pa'),
        Finish(reason),
        Usage(3, 4),
    ]
    response = Response.model_validate(encode_json(events, tools=[WEATHER]))
    (call,) = response.output
    assert call.type == "function_call" and call.status == "incomplete"  # type: ignore[union-attr]
    assert call.arguments == '{"city": "Pa'  # type: ignore[union-attr]
    assert response.status == ("incomplete" if reason == "length" else "completed")
    done = [
        f["item"]
        for f in data_frames(stream_raw(events, tools=[WEATHER]))
        if f["type"] == "response.output_item.done"
    ]
    assert [item["status"] for item in done] == ["incomplete"]


def test_an_encoder_fault_is_a_typed_error_event_with_the_next_sequence_number() -> None:
    """The conformance suite checks every protocol's fault frame; Responses' is the SDK's
    ResponseErrorEvent, numbered after the events already sent (keep-alives are not)."""
    ctx = ctx_for(GenerationRequest(model="m", messages=[]), "m", "req_1")
    chunks = [b": keep-alive\n\n", b"event: response.created\ndata: {}\n\n"]

    def encoder() -> Iterator[bytes]:
        yield from chunks
        raise KeyError("bug")

    body = b"".join(closing_stream(encoder(), ctx, lambda: None, OpenAIResponses()))
    data = json.loads(body.decode().strip().split("\n\n")[-1].split("data: ", 1)[1])
    event = ResponseErrorEvent.model_validate(data)
    assert (event.type, event.sequence_number, event.code) == ("error", 1, "server_error")
    assert "KeyError" in event.message


# ---------------------------------------------------------------- behind the real qwen3 stages


def test_responses_over_real_stages() -> None:
    body: dict[str, Any] = {
        "model": "demo",
        "input": "weather?",
        "tools": [{"type": "function", "name": "get_weather", "parameters": QWEN3_WEATHER_PARAMS}],
    }
    events, ctx = scripted_pipeline("qwen3", PROTOCOL, body, QWEN3_PIECES, PromptReady(20))
    response = Response.model_validate(PROTOCOL.encode_json(events, ctx))
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    reasoning, call = response.output
    assert reasoning.content and reasoning.content[0].text == "Need weather."  # type: ignore[union-attr]
    assert call.arguments == '{"city": "Oslo", "days": 3}'  # type: ignore[union-attr]
