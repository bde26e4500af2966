"""A fault inside an encoder mid-stream still ends the SSE body with an in-protocol
error (never a silently truncated, normal-looking end), and the engine job is released."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from pipeserve.api.anthropic_messages import AnthropicMessages
from pipeserve.api.base import WireProtocol
from pipeserve.api.openai_chat import OpenAIChat
from pipeserve.api.openai_responses import OpenAIResponses
from pipeserve.errors import ApiError
from pipeserve.server.generation import closing_stream
from pipeserve.request import GenerationRequest
from pipeserve.stages.base import RequestContext


def faulty_encoder() -> Iterator[bytes]:
    yield b'data: {"partial": true}\n\n'
    raise KeyError("bug in an encoder")


@pytest.mark.parametrize("protocol", [OpenAIChat(), AnthropicMessages(), OpenAIResponses()], ids=lambda p: p.name)
def test_encoder_fault_ends_with_an_error_event(protocol: WireProtocol) -> None:
    ctx = RequestContext(request=GenerationRequest(model="m", messages=[]), request_id="req_1", model_name="m")
    stopped: list[bool] = []
    body = b"".join(closing_stream(faulty_encoder(), ctx, lambda: stopped.append(True), protocol))
    last = body.decode().strip().split("\n\n")[-1]
    lines = dict(line.split(": ", 1) for line in last.split("\n"))
    assert lines["event"] == "error"
    error = ApiError("internal", "internal error while streaming: KeyError")
    assert json.loads(lines["data"]) == protocol.error_body(error)
    assert stopped == [True] and ctx.cancelled
