"""OpenAI Responses through the official SDK against a real replay server."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from tests.server.scenarios import FAMILIES, WEATHER_TOOL_SCHEMA, Family

pytestmark = pytest.mark.server

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": WEATHER_TOOL_SCHEMA,
    }
]


@pytest.fixture(scope="module")
def client(replay_server: str) -> OpenAI:
    return OpenAI(base_url=f"{replay_server}/v1", api_key="test", max_retries=0)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.model)
def test_plain_text(client: OpenAI, family: Family) -> None:
    response = client.responses.create(
        model=family.model, input="Say hello", extra_body={"mock_response": family.text}
    )
    assert response.status == "completed"
    assert response.output_text == "Hello there!"
    assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.model)
def test_reasoning_stream_final_response(client: OpenAI, family: Family) -> None:
    with client.responses.stream(
        model=family.model,
        input="Say hello",
        reasoning={"effort": "low"},
        extra_body={"mock_response": family.reasoning},
    ) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_response()
    assert events[0] == "response.created" and events[-1] == "response.completed"
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == "Hello there!"
    assert final.usage.output_tokens_details.reasoning_tokens > 0


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.model)
def test_function_call_round_trip(client: OpenAI, family: Family) -> None:
    first = client.responses.create(
        model=family.model,
        input="Weather in Paris?",
        tools=TOOLS,
        extra_body={"mock_response": family.tool_call},
    )
    call = next(item for item in first.output if item.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 3}
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'},
    ]
    second = client.responses.create(
        model=family.model,
        input=history,
        tools=TOOLS,
        extra_body={"mock_response": family.after_tool},
    )
    assert second.output_text == "It is sunny in Paris."


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.model)
def test_streamed_function_call(client: OpenAI, family: Family) -> None:
    with client.responses.stream(
        model=family.model,
        input="Weather?",
        tools=TOOLS,
        extra_body={"mock_response": family.tool_call},
    ) as stream:
        final = stream.get_final_response()
    call = next(item for item in final.output if item.type == "function_call")
    assert json.loads(call.arguments) == {"city": "Paris", "days": 3}


def test_codex_style_request(client: OpenAI, replay_server: str) -> None:
    """Codex CLI: developer prompt first, item ids, non-function tools, store false."""
    import httpx

    body = {
        "model": "replay-qwen3",
        "stream": True,
        "store": False,
        "parallel_tool_calls": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "abc",
        "client_metadata": {"x": "y"},
        "reasoning": {"effort": "medium", "summary": "auto"},
        "tool_choice": "auto",
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "You are Codex. " * 2000}],
            },
            {
                "type": "message",
                "role": "user",
                "id": "msg_1",
                "content": [{"type": "input_text", "text": "hi"}],
            },
        ],
        "tools": [
            {
                "type": "function",
                "name": "shell",
                "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
                "strict": False,
            },
            {
                "type": "custom",
                "name": "apply_patch",
                "description": "patch",
                "format": {"type": "text"},
            },
            {"type": "web_search"},
            {"type": "tool_search"},
            {"type": "namespace", "name": "mcp", "tools": []},
        ],
        "mock_response": "<think>\n</think>\n\nDone.",
    }
    with httpx.stream("POST", f"{replay_server}/v1/responses", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line[6:]) for line in lines]
    types = [e["type"] for e in events]
    assert "response.output_item.done" in types and types[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done_items = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done_items[-1]["content"][0]["text"] == "Done."
