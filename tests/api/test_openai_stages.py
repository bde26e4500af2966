"""The real text stages (thinking, tool_calls json, stop_sequences) feeding the OpenAI encoders."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from pipeserve.api.base import RequestMeta
from pipeserve.api.openai_chat.protocol import OpenAIChat
from pipeserve.api.openai_responses.protocol import OpenAIResponses
from pipeserve.events import Event, Finish, PromptReady, TokenText, Usage
from pipeserve.stages import STAGE_REGISTRY, BuildEnv, load_builtin_stages
from pipeserve.stages.base import RequestContext
from tests.api.test_openai_common import make_ctx

ENV = BuildEnv(model_name="demo", family="qwen3")
STAGES = [
    ("thinking", {"start": "<think>", "end": "</think>"}),
    ("tool_calls", {"format": "json", "start": "<tool_call>", "end": "</tool_call>"}),
    ("stop_sequences", {}),
]
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
}
# qwen3-style output, split into the pieces a tokenizer would produce (markers are single tokens)
PIECES = [
    "<think>",
    "\n",
    "Need",
    " weather",
    ".\n",
    "</think>",
    "\n\n",
    "<tool_call>",
    "\n",
    '{"name": "get',
    '_weather", "arguments": {"city": "Os',
    'lo", "days": "3"}}',
    "\n",
    "</tool_call>",
]


def run_chain(ctx: RequestContext) -> Iterator[Event]:
    load_builtin_stages()
    stages = [STAGE_REGISTRY[kind] for kind, _ in STAGES]
    built = [
        spec.factory(spec.params_model(**params), ENV) for spec, (_, params) in zip(stages, STAGES)
    ]
    for stage in built:
        stage.prepare(ctx)

    def generate() -> Iterator[Event]:
        yield PromptReady(20)
        for i, piece in enumerate(PIECES):
            yield TokenText(piece, 100 + i)
        yield Finish("stop")
        yield Usage(20, len(PIECES) + 1)

    events: Iterator[Event] = generate()
    for stage in built:
        events = stage(events, ctx)
    return events


def test_chat_over_real_stages() -> None:
    body: dict[str, Any] = {
        "model": "demo",
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [
            {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}
        ],
    }
    protocol = OpenAIChat()
    ctx = make_ctx(protocol.decode(body, RequestMeta("/v1/chat/completions")))
    choice = ChatCompletion.model_validate(protocol.encode_json(run_chain(ctx), ctx)).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert (call.function.name, call.function.arguments) == (
        "get_weather",
        '{"city": "Oslo", "days": 3}',
    )  # type: ignore[union-attr]
    assert call.id.startswith("call_")


def test_responses_over_real_stages() -> None:
    body: dict[str, Any] = {
        "model": "demo",
        "input": "weather?",
        "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMS}],
    }
    protocol = OpenAIResponses()
    ctx = make_ctx(protocol.decode(body, RequestMeta("/v1/responses")))
    response = Response.model_validate(protocol.encode_json(run_chain(ctx), ctx))
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    reasoning, call = response.output
    assert reasoning.content and reasoning.content[0].text == "Need weather."  # type: ignore[union-attr]
    assert call.arguments == '{"city": "Oslo", "days": 3}'  # type: ignore[union-attr]
