"""A fault inside an encoder mid-stream still ends the SSE body with an in-protocol
error (never a silently truncated, normal-looking end), and the engine job is released."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from pipeserve.api.anthropic_messages.protocol import AnthropicMessages
from pipeserve.api.base import WireProtocol
from pipeserve.api.openai_chat.protocol import OpenAIChat
from pipeserve.api.openai_responses.protocol import OpenAIResponses
from pipeserve.errors import ApiError
from pipeserve.request import GenerationRequest
from pipeserve.server.generation import closing_stream
from pipeserve.stages.base import RequestContext


def faulty_encoder() -> Iterator[bytes]:
    yield b'data: {"partial": true}\n\n'
    raise KeyError("bug in an encoder")


@pytest.mark.parametrize(
    "protocol", [OpenAIChat(), AnthropicMessages(), OpenAIResponses()], ids=lambda p: p.name
)
def test_encoder_fault_ends_with_an_error_event(protocol: WireProtocol) -> None:
    ctx = RequestContext(
        request=GenerationRequest(model="m", messages=[]), request_id="req_1", model_name="m"
    )
    stopped: list[bool] = []
    body = b"".join(closing_stream(faulty_encoder(), ctx, lambda: stopped.append(True), protocol))
    last = body.decode().strip().split("\n\n")[-1]
    lines = dict(line.split(": ", 1) for line in last.split("\n"))
    assert lines["event"] == "error"
    error = ApiError("internal", "internal error while streaming: KeyError")
    assert json.loads(lines["data"]) == protocol.stream_fault(error, 1)
    assert stopped == [True] and ctx.cancelled


def test_responses_encoder_fault_is_a_typed_error_event() -> None:
    from openai.types.responses import ResponseErrorEvent

    ctx = RequestContext(
        request=GenerationRequest(model="m", messages=[]), request_id="req_1", model_name="m"
    )
    chunks = [b": keep-alive\n\n", b"event: response.created\ndata: {}\n\n"]

    def encoder() -> Iterator[bytes]:
        yield from chunks
        raise KeyError("bug")

    body = b"".join(closing_stream(encoder(), ctx, lambda: None, OpenAIResponses()))
    data = json.loads(body.decode().strip().split("\n\n")[-1].split("data: ", 1)[1])
    event = ResponseErrorEvent.model_validate(data)
    assert (event.type, event.sequence_number, event.code) == ("error", 1, "server_error")
    assert "KeyError" in event.message
