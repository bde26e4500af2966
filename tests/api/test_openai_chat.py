"""OpenAI Chat Completions: decode tables, encoders checked with the SDK's own models."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from pipeserve.api import load_builtin_protocols
from pipeserve.api.base import RequestMeta
from pipeserve.api.openai_chat.protocol import OpenAIChat
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
    TopLogprob,
    Usage,
)
from pipeserve.request import GenerationRequest
from pipeserve.stages.base import RequestContext
from tests.api.helpers import (
    QWEN3_PIECES,
    QWEN3_WEATHER_PARAMS,
    Harness,
    ctx_for,
    openai_stream,
    parse_sse,
    scripted_pipeline,
)

PROTOCOL = OpenAIChat()
META = RequestMeta(route="/v1/chat/completions")
USER = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def decode(**body: Any) -> GenerationRequest:
    return PROTOCOL.decode({"model": "demo", "messages": USER, **body}, META)


def test_registered_under_its_name() -> None:
    assert load_builtin_protocols()["openai-chat"] is OpenAIChat


# ---------------------------------------------------------------- decode


def test_decode_full_conversation() -> None:
    req = decode(
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "system",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "user", "content": "weather?", "name": "bob"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "need a tool",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": "call_1",
                "content": [{"type": "text", "text": "sunny"}],
            },
            {"role": "assistant", "content": "It is sunny."},
        ],
        tools=[WEATHER, {"type": "custom", "custom": {"name": "grammar_tool"}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        stop="END",
        temperature=0.2,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        seed=7,
        max_tokens=50,
        max_completion_tokens=60,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
        top_logprobs=3,
        reasoning_effort="low",
        parallel_tool_calls=False,
        mock_response="canned",
        # fields we do not implement are accepted and ignored
        user="u1",
        metadata={"k": "v"},
        service_tier="auto",
        store=False,
        prompt_cache_key="abc",
        response_format={"type": "text"},  # json formats are refused: test_spec_audit_chat
        frequency_penalty=0.5,
        presence_penalty=-0.25,
        logit_bias={"42": 5, "7": -100},
    )
    assert [(m.role, m.content) for m in req.messages] == [
        ("system", "be brief"),
        ("system", "ab"),
        ("user", "weather?"),
        ("assistant", ""),
        ("tool", "sunny"),
        ("assistant", "It is sunny."),
    ]
    assistant, tool = req.messages[3], req.messages[4]
    assert assistant.reasoning == "need a tool"
    assert [(c.id, c.name, c.arguments) for c in assistant.tool_calls] == [
        ("call_1", "get_weather", '{"city":"Oslo"}')
    ]
    assert (tool.tool_call_id, tool.name) == ("call_1", "get_weather")
    assert [t.name for t in req.tools] == ["get_weather"]
    assert req.tools[0].parameters["properties"] == {"city": {"type": "string"}}
    assert (req.tool_choice.mode, req.tool_choice.name) == ("function", "get_weather")
    assert req.stop == ["END"]
    s = req.sampling
    assert (s.frequency_penalty, s.presence_penalty) == (0.5, -0.25)
    assert s.logit_bias == {42: 5.0, 7: -100.0}
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty, s.seed) == (
        0.2,
        0.9,
        40,
        0.05,
        1.1,
        7,
    )
    assert req.max_tokens == 60  # max_completion_tokens wins
    assert req.stream and req.include_usage is True
    assert (req.logprobs, req.top_logprobs) == (True, 3)
    assert (req.reasoning.effort, req.reasoning.enabled) == ("low", None)
    assert req.parallel_tool_calls is False
    assert req.mock_response == "canned"


def test_decode_defaults() -> None:
    req = decode()
    assert req.model == "demo" and req.messages[0].content == "hi"
    assert req.tools == [] and req.tool_choice.mode == "auto"
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.top_k) == (1.0, 1.0, 0)
    assert req.max_tokens is None and req.stop == [] and not req.stream
    assert req.include_usage is False
    assert req.reasoning.enabled is None and req.parallel_tool_calls


@pytest.mark.parametrize(
    ("body", "check"),
    [
        ({"reasoning_effort": "none"}, lambda r: r.reasoning.enabled is False),
        ({"stop": ["a", "", "b", "c", "d", "e"]}, lambda r: r.stop == ["a", "b", "c", "d", "e"]),
        ({"stop": None}, lambda r: r.stop == []),
        ({"max_tokens": 5}, lambda r: r.max_tokens == 5),
        (
            {"temperature": 0, "top_p": 1},
            lambda r: (r.sampling.temperature, r.sampling.top_p) == (0, 1),
        ),
        ({"top_k": -1}, lambda r: r.sampling.top_k == 0),
        ({"n": 1}, lambda r: True),
        (
            {"messages": [{"role": "assistant", "content": "a", "reasoning": "r"}]},
            lambda r: r.messages[0].reasoning == "r",
        ),
        ({"tool_choice": "none", "tools": [WEATHER]}, lambda r: r.tool_choice.mode == "none"),
        (
            {"tool_choice": "required", "tools": [WEATHER]},
            lambda r: r.tool_choice.mode == "required",
        ),
        (
            {"tools": [{"function": WEATHER["function"]}]},
            lambda r: r.tools[0].name == "get_weather",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}]},
            lambda r: r.tools[0].parameters["type"] == "object",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c", "function": {"name": "f", "arguments": {"x": 1}}}
                        ],
                    }
                ]
            },
            lambda r: r.messages[0].tool_calls[0].arguments == '{"x": 1}',
        ),
        (
            {"messages": [{"role": "function", "name": "f", "content": "out"}]},
            lambda r: r.messages[0].role == "tool",
        ),
    ],
)
def test_decode_variants(body: dict[str, Any], check: Any) -> None:
    assert check(decode(**body))


BAD_REQUESTS: list[tuple[Any, str | None]] = [
    ([1, 2], None),
    ("text", None),
    ({"messages": USER}, "model"),
    ({"model": "demo"}, "messages"),
    ({"model": "demo", "messages": []}, "messages"),
    ({"model": "demo", "messages": "hi"}, "messages"),
    ({"model": 5, "messages": USER}, "model"),
    ({"model": "demo", "messages": [{"content": "x"}]}, "messages[0].role"),
    ({"model": "demo", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"model": "demo", "messages": [{"role": "user"}]}, "messages[0].content"),
    ({"model": "demo", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (
        {"model": "demo", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages[0].content[0].text",
    ),
    (
        {"model": "demo", "messages": [{"role": "user", "content": [{"type": "video"}]}]},
        "messages[0].content[0].type",
    ),
    ({"model": "demo", "messages": [{"role": "user", "content": ["x"]}]}, "messages[0].content[0]"),
    ({"model": "demo", "messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    (
        {"model": "demo", "messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]},
        "messages[0].tool_calls[0].function",
    ),
    ({"model": "demo", "messages": USER, "temperature": 2.5}, "temperature"),
    ({"model": "demo", "messages": USER, "temperature": -1}, "temperature"),
    ({"model": "demo", "messages": USER, "temperature": "hot"}, "temperature"),
    ({"model": "demo", "messages": USER, "top_p": 1.5}, "top_p"),
    ({"model": "demo", "messages": USER, "min_p": 2}, "min_p"),
    ({"model": "demo", "messages": USER, "repetition_penalty": 0}, "repetition_penalty"),
    ({"model": "demo", "messages": USER, "presence_penalty": 3}, "presence_penalty"),
    ({"model": "demo", "messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"model": "demo", "messages": USER, "max_completion_tokens": -5}, "max_completion_tokens"),
    ({"model": "demo", "messages": USER, "max_tokens": 1.5}, "max_tokens"),
    ({"model": "demo", "messages": USER, "n": 1000}, "n"),
    ({"model": "demo", "messages": USER, "seed": "x"}, "seed"),
    ({"model": "demo", "messages": USER, "stream": "yes"}, "stream"),
    (
        {"model": "demo", "messages": USER, "stream_options": {"include_usage": 1}},
        "stream_options.include_usage",
    ),
    ({"model": "demo", "messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"model": "demo", "messages": USER, "top_logprobs": 2}, "top_logprobs"),
    ({"model": "demo", "messages": USER, "stop": 5}, "stop"),
    ({"model": "demo", "messages": USER, "stop": ["a", 1]}, "stop"),
    ({"model": "demo", "messages": USER, "reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"model": "demo", "messages": USER, "tools": {"a": 1}}, "tools"),
    ({"model": "demo", "messages": USER, "tools": [{"type": "function"}]}, "tools[0].function"),
    (
        {
            "model": "demo",
            "messages": USER,
            "tools": [{"type": "function", "function": {"name": ""}}],
        },
        "tools[0].function.name",
    ),
    (
        {
            "model": "demo",
            "messages": USER,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}],
        },
        "tools[0].function.parameters",
    ),
    (
        {"model": "demo", "messages": USER, "tool_choice": "sometimes", "tools": [WEATHER]},
        "tool_choice",
    ),
    ({"model": "demo", "messages": USER, "tool_choice": "required"}, "tool_choice"),
    (
        {
            "model": "demo",
            "messages": USER,
            "tool_choice": {"type": "function"},
            "tools": [WEATHER],
        },
        "tool_choice.function.name",
    ),
    (
        {
            "model": "demo",
            "messages": USER,
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
        "tool_choice",
    ),
    ({"model": "demo", "messages": USER, "mock_response": 3}, "mock_response"),
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


def test_images_are_a_clear_400() -> None:
    content = [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:,"}},
    ]
    with pytest.raises(ApiError) as info:
        decode(messages=[{"role": "user", "content": content}])
    assert info.value.param == "messages[0].content[1]"
    assert "images are not supported by this model" in info.value.message


# ---------------------------------------------------------------- encode (JSON)

TEXT_RUN: list[Event] = [
    PromptReady(12, 4),
    ContentDelta("Hello"),
    ContentDelta(" world"),
    Finish("stop"),
    Usage(12, 3, 4),
]
REASONING_TOOL_RUN: list[Event] = [
    PromptReady(30),
    ReasoningDelta("Need the "),
    ReasoningDelta("weather."),
    ContentDelta("\n\n"),
    ToolCallStart(0, "call_a", "get_weather"),
    ToolCallArgsDelta(0, '{"city": '),
    ToolCallArgsDelta(0, '"Oslo"}'),
    ToolCallEnd(0, '{"city": "Oslo"}'),
    ToolCallStart(1, "call_b", "get_weather"),
    ToolCallEnd(1, '{"city": "Rome"}'),
    Finish("tool_calls"),
    Usage(30, 25, 0, 6),
]


def encode_json(events: list[Event], **body: Any) -> dict[str, Any]:
    req = decode(**body)
    return PROTOCOL.encode_json(iter(events), ctx_for(req))


def test_json_text_completion() -> None:
    body = encode_json(TEXT_RUN)
    completion = ChatCompletion.model_validate(body)
    assert completion.object == "chat.completion" and completion.id.startswith("chatcmpl-")
    assert completion.model == "demo"
    choice = completion.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == (
        "assistant",
        "Hello world",
        "stop",
    )
    assert (
        choice.message.tool_calls is None
        and "reasoning_content" not in body["choices"][0]["message"]
    )
    assert completion.usage is not None
    assert (
        completion.usage.prompt_tokens,
        completion.usage.completion_tokens,
        completion.usage.total_tokens,
    ) == (12, 3, 15)
    assert (
        completion.usage.prompt_tokens_details
        and completion.usage.prompt_tokens_details.cached_tokens == 4
    )
    assert body["choices"][0]["logprobs"] is None


def test_json_reasoning_and_tool_calls() -> None:
    body = encode_json(REASONING_TOOL_RUN)
    choice = ChatCompletion.model_validate(body).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None  # only whitespace besides the calls
    assert body["choices"][0]["message"]["reasoning_content"] == "Need the weather."
    calls = choice.message.tool_calls or []
    assert [(c.id, c.type, c.function.name, c.function.arguments) for c in calls] == [  # type: ignore[union-attr]
        ("call_a", "function", "get_weather", '{"city": "Oslo"}'),
        ("call_b", "function", "get_weather", '{"city": "Rome"}'),
    ]
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 6


@pytest.mark.parametrize(
    ("reason", "expected"), [("stop", "stop"), ("length", "length"), ("tool_calls", "tool_calls")]
)
def test_json_finish_reasons(reason: Any, expected: str) -> None:
    body = encode_json([ContentDelta("x"), Finish(reason), Usage(1, 1)])
    assert body["choices"][0]["finish_reason"] == expected


def test_json_tokens_without_text_stages_are_content_with_logprobs() -> None:
    tops = (TopLogprob("Hi", -0.1, 5), TopLogprob("Yo", -2.5, 6))
    events: list[Event] = [
        TokenText("Hi", 5, -0.1, tops),
        TokenText("!", 0, -0.3, tops),
        Finish("stop"),
        Usage(1, 2),
    ]
    body = encode_json(events, logprobs=True, top_logprobs=1)
    choice = ChatCompletion.model_validate(body).choices[0]
    assert choice.message.content == "Hi!"
    assert choice.logprobs and choice.logprobs.content
    assert [(t.token, t.logprob, t.bytes) for t in choice.logprobs.content] == [
        ("Hi", -0.1, [72, 105]),
        ("!", -0.3, [33]),
    ]
    assert [t.token for t in choice.logprobs.content[0].top_logprobs] == ["Hi"]


def logprob_script(ctx: RequestContext) -> Iterator[Event]:
    """What generate + thinking stages produce: logprobs recorded in ctx.logprob_records, lazily."""
    records = ctx.logprob_records
    records.append(TokenText("<think>", 1, -0.01))
    records.append(TokenText("hmm", 2, -0.02))
    yield ReasoningDelta("hmm")
    records.append(TokenText("Yes", 3, -0.3, (TopLogprob("Yes", -0.3, 3),)))
    yield ContentDelta("Yes")
    records.append(TokenText(".", 4, -0.4))
    yield ContentDelta(".")
    yield Finish("stop")
    yield Usage(5, 4)


def test_json_logprobs_from_the_context_records_skip_reasoning() -> None:
    req = decode(logprobs=True, top_logprobs=1)
    ctx = ctx_for(req)
    body = PROTOCOL.encode_json(iter(logprob_script(ctx)), ctx)
    content = body["choices"][0]["logprobs"]["content"]
    assert [(e["token"], e["logprob"]) for e in content] == [("Yes", -0.3), (".", -0.4)]
    assert content[0]["top_logprobs"] == [
        {"token": "Yes", "logprob": -0.3, "bytes": [89, 101, 115]}
    ]
    ChatCompletion.model_validate(body)


@pytest.mark.parametrize(
    ("events", "kind"),
    [
        (
            [PromptReady(3), ErrorEvent("internal", "engine fault"), Finish("error"), Usage(3, 0)],
            "internal",
        ),
        ([ErrorEvent("timeout", "too slow"), Finish("error"), Usage(3, 0)], "timeout"),
        ([ErrorEvent("weird-kind", "?"), Finish("error"), Usage(3, 0)], "internal"),
        ([ContentDelta("par"), Finish("cancelled"), Usage(3, 1)], "internal"),
    ],
)
def test_json_failures_raise_api_error(events: list[Event], kind: str) -> None:
    with pytest.raises(ApiError) as info:
        encode_json(events)
    assert info.value.kind == kind
    assert PROTOCOL.error_status(info.value) >= 500


# ---------------------------------------------------------------- encode (SSE)


def stream_frames(events: list[Event], **body: Any) -> list[dict[str, Any]]:
    req = decode(stream=True, **body)
    raw = b"".join(PROTOCOL.encode_stream(iter(events), ctx_for(req)))
    return parse_sse(raw)


def chunks_of(frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [json.loads(f["data"]) for f in frames if f["data"] and f["data"] != "[DONE]"]


def accumulate(chunks: list[dict[str, Any]]) -> Any:
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    return state.get_final_completion()


def test_stream_text_with_usage_chunk() -> None:
    frames = stream_frames([KeepAlive(), *TEXT_RUN], stream_options={"include_usage": True})
    assert frames[-1]["data"] == "[DONE]"
    assert any(f["comment"] == "keep-alive" for f in frames)
    chunks = chunks_of(frames)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 15
    assert all(c["usage"] is None for c in chunks[:-1])
    final = accumulate(chunks)
    assert final.choices[0].message.content == "Hello world"
    assert final.usage and final.usage.prompt_tokens == 12


def test_stream_without_include_usage_has_no_usage_chunk() -> None:
    chunks = chunks_of(stream_frames(TEXT_RUN))
    assert all(c["choices"] for c in chunks)
    assert all("usage" not in c for c in chunks)


def test_stream_tool_call_fragments() -> None:
    chunks = chunks_of(stream_frames(REASONING_TOOL_RUN))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    assert reasoning == "Need the weather."
    tool_deltas = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert tool_deltas[0] == {
        "index": 0,
        "id": "call_a",
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert tool_deltas[1] == {"index": 0, "function": {"arguments": '{"city": '}}
    assert tool_deltas[2] == {"index": 0, "function": {"arguments": '"Oslo"}'}}
    # a call whose arguments came only with ToolCallEnd still streams them
    assert tool_deltas[3]["id"] == "call_b" and tool_deltas[4] == {
        "index": 1,
        "function": {"arguments": '{"city": "Rome"}'},
    }
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    final = accumulate(chunks)
    calls = final.choices[0].message.tool_calls
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [
        ("call_a", "get_weather", '{"city": "Oslo"}'),
        ("call_b", "get_weather", '{"city": "Rome"}'),
    ]


def test_stream_logprobs_per_chunk() -> None:
    req = decode(stream=True, logprobs=True, top_logprobs=1)
    ctx = ctx_for(req)
    chunks = chunks_of(parse_sse(b"".join(PROTOCOL.encode_stream(iter(logprob_script(ctx)), ctx))))
    with_logprobs = [
        c["choices"][0]["logprobs"]["content"] for c in chunks if c["choices"][0]["logprobs"]
    ]
    assert [[e["token"] for e in lp] for lp in with_logprobs] == [["Yes"], ["."]]
    final = accumulate(chunks)
    assert [t.token for t in final.choices[0].logprobs.content] == ["Yes", "."]


def test_stream_error_mid_stream_raises_in_sdk() -> None:
    events: list[Event] = [
        ContentDelta("partial"),
        ErrorEvent("internal", "engine fault"),
        Finish("error"),
        Usage(3, 1),
    ]
    req = decode(stream=True)
    raw = b"".join(PROTOCOL.encode_stream(iter(events), ctx_for(req)))
    assert b"[DONE]" not in raw
    seen = []
    with pytest.raises(openai.APIError, match="engine fault"):
        for chunk in openai_stream(raw, ChatCompletionChunk):
            seen.append(chunk)
    assert seen[-1].choices[0].delta.content == "partial"


def test_stream_cancel_ends_with_error() -> None:
    frames = stream_frames([ContentDelta("a"), Finish("cancelled"), Usage(1, 1)])
    last = json.loads(frames[-1]["data"])
    assert last["error"]["type"] == "server_error" and "cancelled" in last["error"]["message"]


def test_stream_closes_upstream_generator() -> None:
    closed = []

    def upstream() -> Any:
        try:
            yield ContentDelta("a")
            yield ErrorEvent("internal", "x")
            yield Finish("error")
            yield Usage(1, 1)
        finally:
            closed.append(True)

    req = decode(stream=True)
    list(PROTOCOL.encode_stream(upstream(), ctx_for(req)))
    assert closed == [True]


# ---------------------------------------------------------------- the official SDK end to end (in process)


def weather_script(ctx: RequestContext) -> list[Event]:
    """A model that calls get_weather, then answers from the tool result."""
    last = ctx.request.messages[-1]
    if last.role == "tool":
        return [
            PromptReady(40),
            ContentDelta(f"It is {last.content} in Oslo."),
            Finish("stop"),
            Usage(40, 6),
        ]
    return REASONING_TOOL_RUN[:8] + [Finish("tool_calls"), Usage(30, 20, 0, 4)]


def test_sdk_plain_and_stream() -> None:
    harness = Harness(PROTOCOL, lambda ctx: list(TEXT_RUN))
    client = harness.client
    completion = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "hi"}]
    )
    assert completion.choices[0].message.content == "Hello world"
    stream = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello world"
    assert chunks[-1].usage and chunks[-1].usage.total_tokens == 15
    with client.chat.completions.stream(
        model="demo", messages=[{"role": "user", "content": "hi"}]
    ) as helper:
        final = helper.get_final_completion()
    assert final.choices[0].message.content == "Hello world"


def test_sdk_tool_round_trip() -> None:
    harness = Harness(PROTOCOL, weather_script)
    client = harness.client
    messages: list[Any] = [{"role": "user", "content": "Weather in Oslo?"}]
    first = client.chat.completions.create(
        model="demo", messages=messages, tools=[WEATHER], tool_choice="auto"
    )
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.tool_calls
    call = message.tool_calls[0]
    messages.append(message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny"})
    with client.chat.completions.stream(model="demo", messages=messages, tools=[WEATHER]) as stream:
        answer = stream.get_final_completion()
    assert answer.choices[0].message.content == "It is sunny in Oslo."
    replayed = harness.requests[-1].messages
    assert (
        replayed[1].tool_calls[0].name == "get_weather"
        and replayed[1].reasoning == "Need the weather."
    )
    assert (replayed[2].role, replayed[2].tool_call_id, replayed[2].name) == (
        "tool",
        call.id,
        "get_weather",
    )


def test_sdk_bad_request_names_param() -> None:
    client = Harness(PROTOCOL, lambda ctx: []).client
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "hi"}], temperature=3
        )
    assert info.value.status_code == 400 and info.value.param == "temperature"
    assert info.value.type == "invalid_request_error"


def test_sdk_internal_error_is_500() -> None:
    client = Harness(
        PROTOCOL, lambda ctx: [ErrorEvent("internal", "boom"), Finish("error"), Usage(1, 0)]
    ).client
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}])


# A call whose arguments never became a JSON object (malformed, or cut at max tokens)
# does not make the turn a tool call: the finish reason keeps what generation said.
BROKEN_CALL = [
    ToolCallStart(0, "call_b", "get_weather"),
    ToolCallArgsDelta(0, '{"city" 1'),
    ToolCallEnd(0, '{"city" 1'),
]


@pytest.mark.parametrize(("reason", "expected"), [("stop", "stop"), ("length", "length")])
def test_broken_call_does_not_finish_tool_calls(reason: Any, expected: str) -> None:
    events = [*BROKEN_CALL, Finish(reason), Usage(3, 4)]
    assert encode_json(list(events))["choices"][0]["finish_reason"] == expected
    chunks = chunks_of(stream_frames(list(events)))
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == expected


def test_valid_call_still_upgrades_stop_to_tool_calls() -> None:
    events = [
        ToolCallStart(0, "call_a", "f"),
        ToolCallEnd(0, '{"a": 1}'),
        *BROKEN_CALL[:0],
        Finish("stop"),
        Usage(3, 4),
    ]
    assert encode_json(events)["choices"][0]["finish_reason"] == "tool_calls"


# ---------------------------------------------------------------- behind the real qwen3 stages


def test_chat_over_real_stages() -> None:
    body: dict[str, Any] = {
        "model": "demo",
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [
            {
                "type": "function",
                "function": {"name": "get_weather", "parameters": QWEN3_WEATHER_PARAMS},
            }
        ],
    }
    events, ctx = scripted_pipeline("qwen3", PROTOCOL, body, QWEN3_PIECES, PromptReady(20))
    choice = ChatCompletion.model_validate(PROTOCOL.encode_json(events, ctx)).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert (call.function.name, call.function.arguments) == (
        "get_weather",
        '{"city": "Oslo", "days": 3}',
    )  # type: ignore[union-attr]
    assert call.id.startswith("call_")
