"""What every registered protocol does, driven by the protocol registry: a new protocol
is checked as soon as it is registered (and this suite asks for its minimal request in
tests/api/helpers.py `MINIMAL` and its SDK call here in `ASK`).

Per protocol, on scripted events: a minimal body decodes and unknown fields are
accepted; the streamed and the non-streamed answers carry the same text; a KeepAlive is
framed without ending the stream; a mid-stream error becomes an error in the stream and
an ApiError (with its kind) for the non-streaming answer; a fault inside the encoder
ends the stream with the protocol's fault frame; the engine job is released either way.

Per protocol and demo family (pipelines/*.yaml), stream and non-stream: the family's
model answer (tests/families.py) replayed exactly through its real tokenizer and its
real pipeline, asked and read by the protocol's official client (openai, anthropic,
ollama) in process, gives the same reasoning, text and tool call both ways.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from pipeserve.errors import ApiError
from pipeserve.events import ContentDelta, ErrorEvent, Event, Finish, KeepAlive, PromptReady, Usage
from pipeserve.request import GenerationRequest
from pipeserve.server.generation import closing_stream
from pipeserve.stages.base import RequestContext
from pipeserve.stages.fim import find_fim_tokens, no_fim_message
from tests.api.helpers import (
    MINIMAL,
    PROTOCOL_NAMES,
    InProcess,
    anthropic_client,
    ctx_for,
    family_chain,
    minimal,
    ollama_client,
    openai_client,
    protocol,
)
from tests.families import (
    CALL,
    COMPLETIONS,
    DEMO,
    HAS_REASONING,
    HAS_TEXT,
    REASONING,
    STOPS_ON,
    TEXT,
)
from tests.sdk_answers import Answer, chat_answer, messages_answer, responses_answer


def test_every_registered_protocol_has_a_minimal_request_and_an_sdk_call_here() -> None:
    assert sorted(MINIMAL) == PROTOCOL_NAMES and sorted(ASK) == PROTOCOL_NAMES


class Tracked:
    """A pipeline stream that records whether it was consumed to the end or closed."""

    def __init__(self, events: list[Event]) -> None:
        self.events = events
        self.released = False

    def __iter__(self) -> Iterator[Event]:
        try:
            yield from self.events
        finally:
            self.released = True


def minimal_ctx(name: str, stream: bool) -> tuple[Any, RequestContext]:
    wire, request = minimal(name, stream=stream)
    return wire, ctx_for(request, "m", "req_1", prompt_token_ids=[1, 2, 3])


SCRIPTED_TEXT: list[Event] = [
    PromptReady(3),
    KeepAlive(),
    ContentDelta("Hello"),
    ContentDelta(" world"),
    Finish("stop"),
    Usage(3, 2),
]
FAULT: list[Event] = [
    PromptReady(3),
    ContentDelta("Hel"),
    ErrorEvent("timeout", "request exceeded the server's request_timeout"),
    Finish("error"),
    Usage(3, 1),
]


@pytest.mark.parametrize("name", PROTOCOL_NAMES)
def test_minimal_request_decodes_and_unknown_fields_are_accepted(name: str) -> None:
    _, request = minimal(name, x_not_a_field={"a": 1})
    assert request.model == "m"


@pytest.mark.parametrize("name", PROTOCOL_NAMES)
def test_stream_and_json_carry_the_same_text(name: str) -> None:
    wire, ctx = minimal_ctx(name, stream=False)
    events = Tracked(SCRIPTED_TEXT)
    body = wire.encode_json(iter(events), ctx)
    assert "Hello world" in json.dumps(body) and events.released
    wire, ctx = minimal_ctx(name, stream=True)
    events = Tracked(SCRIPTED_TEXT)
    chunks = list(wire.encode_stream(iter(events), ctx))
    text = b"".join(chunks).decode()
    assert "Hello" in text and " world" in text and events.released
    assert text.index("Hello") < text.index(" world")


@pytest.mark.parametrize("name", PROTOCOL_NAMES)
def test_a_mid_stream_error_ends_the_stream_with_an_error(name: str) -> None:
    wire, ctx = minimal_ctx(name, stream=True)
    events = Tracked(FAULT)
    text = b"".join(wire.encode_stream(iter(events), ctx)).decode()
    assert "request_timeout" in text and events.released
    assert "[DONE]" not in text and "message_stop" not in text
    assert "response.completed" not in text and '"done":true' not in text.replace(" ", "")


@pytest.mark.parametrize("name", PROTOCOL_NAMES)
def test_a_mid_stream_error_is_an_api_error_of_its_kind_without_streaming(name: str) -> None:
    wire, ctx = minimal_ctx(name, stream=False)
    events = Tracked(FAULT)
    with pytest.raises(ApiError) as raised:
        wire.encode_json(iter(events), ctx)
    assert raised.value.kind == "timeout" and events.released


def faulty_encoder() -> Iterator[bytes]:
    yield b'data: {"partial": true}\n\n'
    raise KeyError("bug in an encoder")


@pytest.mark.parametrize("name", PROTOCOL_NAMES)
def test_an_encoder_fault_ends_with_the_protocols_fault_frame(name: str) -> None:
    """A bug inside an encoder mid-stream still ends the body with an in-protocol error
    (never a silently truncated, normal-looking end), and the engine job is released."""
    wire = protocol(name)
    ctx = ctx_for(GenerationRequest(model="m", messages=[]), "m", "req_1")
    stopped: list[bool] = []
    body = b"".join(closing_stream(faulty_encoder(), ctx, lambda: stopped.append(True), wire))
    error = ApiError("internal", "internal error while streaming: KeyError")
    assert body.endswith(wire.fault_frame(error, 1)) and stopped == [True] and ctx.cancelled
    if wire.stream_content_type.startswith("text/event-stream"):  # SSE: a typed error event
        last = body.decode().strip().split("\n\n")[-1]
        lines = dict(line.split(": ", 1) for line in last.split("\n"))
        assert lines["event"] == "error"
        assert json.loads(lines["data"]) == wire.stream_fault(error, 1)
    else:  # NDJSON (Ollama): the last line is the error object its client raises on
        assert json.loads(body.splitlines()[-1]) == wire.error_body(error)


# ---------------------------------------------------------------- every demo family


FN_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
ASK_USER = [{"role": "user", "content": "Weather in Paris?"}]


def ask_chat(handler: InProcess, stream: bool) -> Answer:
    kw: dict[str, Any] = {"model": "demo", "messages": ASK_USER, "tools": [FN_TOOL]}
    return chat_answer(openai_client(handler), kw, stream)


def ask_responses(handler: InProcess, stream: bool) -> Answer:
    tool = {"type": "function", **FN_TOOL["function"]}
    kw: dict[str, Any] = {"model": "demo", "input": "Weather in Paris?", "tools": [tool]}
    return responses_answer(openai_client(handler), kw, stream)


def ask_anthropic(handler: InProcess, stream: bool) -> Answer:
    tool = {"name": "get_weather", "input_schema": FN_TOOL["function"]["parameters"]}
    kw: dict[str, Any] = {
        "model": "demo",
        "max_tokens": 256,
        "messages": ASK_USER,
        "tools": [tool],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    return messages_answer(anthropic_client(handler), kw, stream)


def ask_completions(handler: InProcess, stream: bool) -> Answer:
    """A raw prompt: the model's text as generated, no reasoning or call parsing."""
    client = openai_client(handler)
    kw: dict[str, Any] = {"model": "demo", "prompt": "Weather?", "max_tokens": 256}
    if stream:
        chunks = list(client.completions.create(**kw, stream=True))
        text = "".join(chunk.choices[0].text for chunk in chunks)
        finish = chunks[-1].choices[0].finish_reason or ""
    else:
        completion = client.completions.create(**kw)
        text, finish = completion.choices[0].text, completion.choices[0].finish_reason
    return Answer(text=text, finish=finish)


def ask_ollama(handler: InProcess, stream: bool) -> Answer:
    client = ollama_client(handler)
    kw: dict[str, Any] = {"model": "demo", "messages": ASK_USER, "tools": [FN_TOOL]}
    parts = list(client.chat(**kw, stream=True)) if stream else [client.chat(**kw)]
    answer = Answer(finish=parts[-1].done_reason or "")
    assert parts[-1].done and parts[-1].eval_count
    for part in parts:
        answer.reasoning += part.message.thinking or ""
        answer.text += part.message.content or ""
        for call in part.message.tool_calls or []:
            answer.calls.append((call.function.name, dict(call.function.arguments)))
    return answer


def ask_infill(handler: InProcess, stream: bool) -> Answer:
    """llama.cpp's /infill (no official SDK: its JSON objects read with httpx). A model
    whose vocabulary has no FIM tokens answers a 400 naming the model."""
    client = httpx.Client(transport=httpx.MockTransport(handler), base_url="http://test")
    body = {"model": "demo", "input_prefix": "def f(", "input_suffix": ")", "stream": stream}
    reply = client.post("/infill", json=body)
    if reply.status_code != 200:
        error = reply.json()["error"]
        assert (error["code"], error["param"]) == (reply.status_code, "model")
        return Answer(text=error["message"], finish=str(reply.status_code))
    if not stream:
        return Answer(text=reply.json()["content"], finish=reply.json()["stop_type"])
    objects = [
        json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: ")
    ]
    assert [o["stop"] for o in objects] == [False] * (len(objects) - 1) + [True]
    return Answer(text="".join(o["content"] for o in objects), finish=objects[-1]["stop_type"])


# protocol -> (how its client asks and reads, the httpx flavour that client runs on)
ASK: dict[str, tuple[Callable[[InProcess, bool], Answer], Any]] = {
    "openai-chat": (ask_chat, None),
    "openai-responses": (ask_responses, None),
    "anthropic-messages": (ask_anthropic, None),
    "openai-completions": (ask_completions, None),
    "ollama": (ask_ollama, httpx),
    "llama-cpp": (ask_infill, httpx),
}
# How each protocol says "the turn ended to call tools" and "the model stopped".
TOOL_FINISH = {
    "openai-chat": "tool_calls",
    "openai-responses": "completed",
    "anthropic-messages": "tool_use",
    "ollama": "stop",
}
STOP_FINISH = {"openai-completions": "stop"}


def replayed(runtime: Any, family: str) -> Callable[[RequestContext], list[Event]]:
    """The family's real pipeline on the replay engine, answering `COMPLETIONS[family]`."""
    chain = family_chain(family, runtime)

    def script(ctx: RequestContext) -> list[Event]:
        ctx.request.mock_response = COMPLETIONS[family]
        chain.prepare(ctx)
        return list(chain.run(ctx))

    return script


def expected(name: str, family: str, runtime: Any) -> Answer:
    if name == "openai-completions":  # raw prompt: the family's markup as generated
        text = COMPLETIONS[family].removesuffix(STOPS_ON.get(family, ""))
        return Answer(text=text, finish=STOP_FINISH[name])
    if name == "llama-cpp":  # fill-in-the-middle: raw text where the vocabulary has FIM tokens
        if find_fim_tokens(runtime.tokenizer.get_vocab()) is None:
            demo = DEMO.get(family, family)
            message = no_fim_message(f"replay-{demo}", "model")
            return Answer(text=message, finish="400")
        text = COMPLETIONS[family].removesuffix(STOPS_ON.get(family, ""))
        return Answer(text=text, finish="eos")
    return Answer(
        reasoning=REASONING if HAS_REASONING[family] else "",
        text=TEXT if HAS_TEXT[family] else "",
        calls=[CALL],
        finish=TOOL_FINISH[name],
    )


@pytest.mark.parametrize("family", sorted(COMPLETIONS))
@pytest.mark.parametrize("name", PROTOCOL_NAMES)
def test_every_family_through_every_protocol_and_its_client(
    name: str, family: str, replay_runtime: Callable[[str], Any]
) -> None:
    ask, http = ASK[name]
    runtime = replay_runtime(DEMO.get(family, family))
    kw = {"http": http} if http is not None else {}
    answers = {}
    for stream in (False, True):
        handler = InProcess(protocol(name), replayed(runtime, family), **kw)
        answers[stream] = ask(handler, stream)
        assert handler.requests[0].stream is stream
    assert answers[False] == answers[True] == expected(name, family, runtime)
