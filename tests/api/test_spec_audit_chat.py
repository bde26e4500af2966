"""Chat Completions against the published reference: every response field the API always
sends, every Finish cause, and each request field honoured, ignored or refused by name.

The official openai SDK builds the requests and parses the answers (in-process harness);
its pydantic models and stream accumulator check the shapes.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from pipeserve.api.base import RequestMeta
from pipeserve.api.openai_chat.protocol import OpenAIChat
from pipeserve.errors import ApiError
from pipeserve.events import (
    ContentDelta,
    ErrorEvent,
    Event,
    Finish,
    PromptReady,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from pipeserve.request import GenerationRequest
from tests.api.helpers import QWEN3_CALL, Harness, ctx_for, parse_sse, replay_events

PROTOCOL = OpenAIChat()
META = RequestMeta(route="/v1/chat/completions")
USER = [{"role": "user", "content": "hi"}]


def fn_tool(name: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": {}}},
    }


TEXT: list[Event] = [
    PromptReady(9, 4),
    ReasoningDelta("Think."),
    ContentDelta("Hello"),
    Finish("stop"),
    Usage(9, 5, 4, 2),
]
CALL: list[Event] = [
    PromptReady(9),
    ToolCallStart(0, "call_1", "get_weather"),
    ToolCallArgsDelta(0, '{"city": "Oslo"}'),
    ToolCallEnd(0, '{"city": "Oslo"}'),
    Finish("tool_calls"),
    Usage(9, 7),
]


def decode(**body: Any) -> GenerationRequest:
    return PROTOCOL.decode({"model": "demo", "messages": USER, **body}, META)


def encode_json(events: list[Event], **body: Any) -> dict[str, Any]:
    req = decode(**body)
    return PROTOCOL.encode_json(iter(events), ctx_for(req))


def stream_chunks(events: list[Event], **body: Any) -> list[dict[str, Any]]:
    req = decode(stream=True, **body)
    raw = b"".join(PROTOCOL.encode_stream(iter(events), ctx_for(req)))
    frames = [f["data"] for f in parse_sse(raw) if f["data"] is not None]
    assert frames[-1] == "[DONE]"
    return [json.loads(f) for f in frames[:-1]]


# ---------------------------------------------------------------- response fields


def test_completion_carries_every_always_sent_field() -> None:
    body = encode_json(TEXT)
    ChatCompletion.model_validate(body)
    assert body["service_tier"] == "default"
    assert isinstance(body["system_fingerprint"], str) and body["system_fingerprint"]
    message = body["choices"][0]["message"]
    assert message["annotations"] == [] and message["refusal"] is None
    assert body["choices"][0]["logprobs"] is None  # null, not absent, when not requested
    assert body["usage"] == {
        "prompt_tokens": 9,
        "completion_tokens": 5,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 4, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 2,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def test_every_chunk_carries_the_envelope_and_usage_details() -> None:
    chunks = stream_chunks(TEXT, stream_options={"include_usage": True})
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
        assert chunk["object"] == "chat.completion.chunk"
        assert chunk["service_tier"] == "default" and chunk["system_fingerprint"]
        assert chunk["id"] == chunks[0]["id"] and chunk["created"] == chunks[0]["created"]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    assert all(c["usage"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["choices"] == []
    assert last["usage"]["completion_tokens_details"]["reasoning_tokens"] == 2
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == 4


def test_stream_accumulates_to_the_json_answer() -> None:
    state = ChatCompletionStreamState()
    for chunk in stream_chunks(CALL, tools=[fn_tool("get_weather")]):
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    streamed = state.get_final_completion()
    body = ChatCompletion.model_validate(encode_json(CALL, tools=[fn_tool("get_weather")]))
    assert streamed.choices[0].finish_reason == body.choices[0].finish_reason == "tool_calls"
    calls = streamed.choices[0].message.tool_calls or []
    assert [(c.id, c.function.arguments) for c in calls] == [("call_1", '{"city": "Oslo"}')]  # type: ignore[union-attr]
    assert streamed.system_fingerprint == body.system_fingerprint


FINISHES = [
    ([Finish("stop")], "stop"),
    ([Finish("length")], "length"),
    ([Finish("stop", stop_sequence="END")], "stop"),
    (CALL[1:-1], "tool_calls"),
]


@pytest.mark.parametrize(("events", "reason"), FINISHES)
def test_finish_reason_for_each_cause(events: list[Event], reason: str) -> None:
    run = [PromptReady(3), ContentDelta("x"), *events, Usage(3, 2)]
    assert encode_json(run)["choices"][0]["finish_reason"] == reason
    finals = [c["choices"][0]["finish_reason"] for c in stream_chunks(run) if c["choices"]]
    assert finals[-1] == reason and all(f is None for f in finals[:-1])


@pytest.mark.parametrize(
    "events",
    [
        [ErrorEvent("internal", "boom"), Finish("error")],
        [Finish("cancelled")],
    ],
)
def test_error_and_cancel_are_in_protocol_errors(events: list[Event]) -> None:
    run = [PromptReady(3), ContentDelta("x"), *events, Usage(3, 1)]
    with pytest.raises(ApiError):
        encode_json(run)
    req = decode(stream=True)
    raw = b"".join(PROTOCOL.encode_stream(iter(run), ctx_for(req)))
    frames = [f["data"] for f in parse_sse(raw) if f["data"] is not None]
    assert "[DONE]" not in frames  # no normal-looking end
    assert set(json.loads(frames[-1])["error"]) == {"message", "type", "param", "code"}


# ---------------------------------------------------------------- request fields


def sdk() -> tuple[Harness, Any]:
    harness = Harness(
        PROTOCOL, lambda ctx: [PromptReady(3), ContentDelta("ok"), Finish("stop"), Usage(3, 1)]
    )
    return harness, harness.client.chat.completions


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
        "response_format.json_schema.schema",
    ),
    (
        {"response_format": {"type": "grammar", "syntax": "ebnf", "definition": "x"}},
        "response_format.syntax",
    ),
    ({"logit_bias": {"token": 5}}, "logit_bias"),
    ({"logit_bias": {"42": 101}}, "logit_bias"),
    ({"logit_bias": {"42": "high"}}, "logit_bias"),
    ({"logit_bias": [42]}, "logit_bias"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"n": 0}, "n"),
    ({"prediction": {"type": "content", "content": "x", "extra": 1}}, "prediction.extra"),
    (
        {
            "tools": [{"type": "custom", "custom": {"name": "patch"}}],
            "tool_choice": {"type": "custom", "custom": {"name": "patch"}},
        },
        "tool_choice",
    ),
]


@pytest.mark.parametrize(("fields", "param"), REFUSED)
def test_unhonoured_parameters_are_a_400_naming_them(fields: dict[str, Any], param: str) -> None:
    harness, completions = sdk()
    with pytest.raises(openai.BadRequestError) as info:
        completions.create(model="demo", messages=USER, **fields)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param  # type: ignore[index]
    assert info.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    assert param in info.value.message
    assert harness.requests == []


ACCEPTED: dict[str, Any] = {
    "response_format": {"type": "text"},
    "logit_bias": {},
    "modalities": ["text"],
    "user": "u-1",
    "metadata": {"k": "v"},
    "store": False,
    "service_tier": "auto",
    "prediction": {"type": "content", "content": "draft"},
    "verbosity": "low",
    "prompt_cache_key": "k",
    "safety_identifier": "s",
    "web_search_options": {},
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "seed": 7,
    "n": 1,
    "max_completion_tokens": 12,
    "reasoning_effort": "low",
    "parallel_tool_calls": False,
    "stream_options": None,
}


def test_harmless_parameters_are_accepted() -> None:
    harness, completions = sdk()
    result = completions.create(model="demo", messages=USER, **ACCEPTED)
    assert result.choices[0].message.content == "ok"
    req = harness.requests[0]
    assert req.max_tokens == 12 and req.sampling.seed == 7 and req.reasoning.effort == "low"
    assert req.parallel_tool_calls is False


def test_allowed_tools_restricts_the_tool_list() -> None:
    choice = {
        "type": "allowed_tools",
        "allowed_tools": {
            "mode": "required",
            "tools": [{"type": "function", "function": {"name": "b"}}],
        },
    }
    req = decode(tools=[fn_tool("a"), fn_tool("b")], tool_choice=choice)
    assert [t.name for t in req.tools] == ["b"]
    assert req.tool_choice.mode == "required"
    auto = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}
    assert decode(tools=[fn_tool("a")], tool_choice=auto).tools == []


def test_allowed_tools_required_with_nothing_allowed_is_a_400() -> None:
    choice = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": []}}
    with pytest.raises(ApiError) as info:
        decode(tools=[fn_tool("a")], tool_choice=choice)
    assert info.value.param == "tool_choice"


# ---------------------------------------------------------------- real pipeline (replay engine)


def test_replay_pipeline_stream_and_json_agree_and_validate(qwen3_runtime: Any) -> None:
    body = {
        "model": "replay-qwen3",
        "messages": USER,
        "tools": [fn_tool("get_weather")],
        "mock_response": QWEN3_CALL,
    }
    completion = ChatCompletion.model_validate(
        PROTOCOL.encode_json(*replay_events(qwen3_runtime, PROTOCOL, body, META.route))
    )
    state = ChatCompletionStreamState()
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    raw = b"".join(
        PROTOCOL.encode_stream(*replay_events(qwen3_runtime, PROTOCOL, stream_body, META.route))
    )
    frames = [f["data"] for f in parse_sse(raw) if f["data"] is not None]
    assert frames[-1] == "[DONE]"
    for frame in frames[:-1]:
        state.handle_chunk(ChatCompletionChunk.model_validate_json(frame))
    streamed = state.get_final_completion()
    for result in (completion, streamed):
        choice = result.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
        (call,) = choice.message.tool_calls or []
        assert json.loads(call.function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
        assert result.system_fingerprint and result.service_tier == "default"
    usage = json.loads(frames[-2])["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] > 0
    assert usage["prompt_tokens"] > 0 and usage["prompt_tokens_details"]["cached_tokens"] == 0
