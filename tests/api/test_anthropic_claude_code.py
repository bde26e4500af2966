"""A request shaped like the ones Claude Code 2.1 sends (docs/architecture.md, "Protocols").

`POST /v1/messages?beta=true`, ~76 KB: `system` as text blocks with cache_control, a
`role: "system"` message inside `messages`, tools without `type` (JSON Schema draft-07,
additionalProperties false), thinking adaptive, context_management, output_config,
metadata, max_tokens 32000, stream true. It must decode (not 400), and the stream we
send back must be accumulated by the SDK's beta stream as Claude Code does. The last
tests run it through the real Falcon app (in process, WSGI) on a replay model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx2 as httpx  # the anthropic SDK runs on httpx2 (same API as httpx)
import pytest

from pipeserve.api.anthropic_messages.protocol import AnthropicMessages
from pipeserve.api.base import RequestMeta
from pipeserve.events import (
    ContentDelta,
    Finish,
    KeepAlive,
    PromptReady,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from tests.api.helpers import InProcess, anthropic_client, anthropic_events

PROTOCOL = AnthropicMessages()
META = RequestMeta(
    route="/v1/messages",
    headers={
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
    },
    query={"beta": "true"},
)
CACHE = {"type": "ephemeral"}
TOOL_NAMES = [
    "Task",
    "Bash",
    "Glob",
    "Grep",
    "ExitPlanMode",
    "Read",
    "Edit",
    "Write",
    "NotebookEdit",
    "WebFetch",
    "TodoWrite",
    "WebSearch",
    "BashOutput",
    "KillShell",
    "Skill",
    "SlashCommand",
    "AskUserQuestion",
]
PROSE = (
    "Use this tool when you need to act on the user's codebase. Always prefer specialised tools over shell "
    "commands, quote paths that contain spaces, and never run destructive commands without explicit consent. "
)


def tool(name: str) -> dict[str, Any]:
    schema = {
        "type": "object",
        "properties": {
            "command": {"type": "string", "description": "The command to execute"},
            "timeout": {
                "type": "number",
                "description": "Optional timeout in milliseconds (max 600000)",
            },
            "description": {
                "type": "string",
                "description": "Clear, concise description of what this does",
            },
        },
        "required": ["command"],
        "additionalProperties": False,
        "$schema": "http://json-schema.org/draft-07/schema#",
    }
    return {"name": name, "description": PROSE * 16, "input_schema": schema}


def claude_code_body() -> dict[str, Any]:
    return {
        "model": "demo",
        "messages": [
            {
                "role": "system",
                "content": "The user's working directory is /work/project. Today is 2026-11-02.",
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "text",
                        "text": "<system-reminder>\nAs you answer, use this context: CLAUDE.md says run tests with pytest.\n</system-reminder>",
                    },
                    {"type": "text", "text": "say hi in one line", "cache_control": CACHE},
                ],
            },
        ],
        "system": [
            {
                "type": "text",
                "text": "x-anthropic-billing-header: cc_version=2.1.3; cc_entrypoint=cli",
            },
            {
                "type": "text",
                "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                "cache_control": CACHE,
            },
            {
                "type": "text",
                "text": "You are an interactive CLI tool that helps users with software engineering tasks. "
                * 120,
                "cache_control": CACHE,
            },
        ],
        "tools": [tool(name) for name in TOOL_NAMES],
        "metadata": {"user_id": "user_0f3a_account_9c1e_session_5d2b7e"},
        "max_tokens": 32000,
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"},
        "stream": True,
    }


def test_recorded_body_decodes() -> None:
    raw = json.dumps(claude_code_body())
    assert 70_000 < len(raw) < 90_000
    req = PROTOCOL.decode(json.loads(raw), META)
    assert req.stream and req.max_tokens == 32000 and req.model == "demo"
    assert [m.role for m in req.messages] == ["system", "user"]
    system = req.messages[0].content
    assert system.startswith("x-anthropic-billing-header") and system.endswith(
        "Today is 2026-11-02."
    )
    assert req.messages[1].content.endswith("</system-reminder>\nsay hi in one line")
    assert [t.name for t in req.tools] == TOOL_NAMES
    assert req.tools[1].parameters["required"] == ["command"]
    assert (req.reasoning.enabled, req.reasoning.effort, req.reasoning.budget_tokens) == (
        True,
        "medium",
        None,
    )


def test_count_tokens_accepts_the_same_body() -> None:
    body = claude_code_body()
    for field in ("max_tokens", "stream", "metadata"):
        del body[field]
    req = PROTOCOL.count_tokens_body(body, META)
    assert req.max_tokens is None and len(req.tools) == len(TOOL_NAMES)


def test_beta_stream_accumulates_our_answer() -> None:
    script = [
        KeepAlive(),
        PromptReady(18_000, 16_384),
        ReasoningDelta("The user wants a greeting."),
        ContentDelta("Hi"),
        ContentDelta("!"),
        ToolCallStart(0, "call_7", "TodoWrite"),
        ToolCallArgsDelta(0, '{"command": '),
        ToolCallEnd(0, '{"command": "echo hi"}'),
        Finish("tool_calls"),
        Usage(18_000, 25, 16_384, reasoning_tokens=6),
    ]
    handler = InProcess(PROTOCOL, script, model=None, request_id="req_cc")
    sdk = anthropic_client(handler)
    body = claude_code_body()
    del body["stream"]
    betas = [
        "claude-code-20250219",
        "interleaved-thinking-2025-05-14",
        "context-management-2025-06-27",
    ]
    with sdk.beta.messages.stream(**body, betas=betas, extra_query={"beta": "true"}) as stream:
        final = stream.get_final_message()
    assert (
        handler.seen[0].url.params.get("beta") == "true"
        and "interleaved" in handler.seen[0].headers["anthropic-beta"]
    )
    assert [block.type for block in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[1].text == "Hi!"  # type: ignore[union-attr]
    assert final.content[2].input == {"command": "echo hi"}  # type: ignore[union-attr]
    assert final.stop_reason == "tool_use"
    usage = final.usage
    assert (usage.input_tokens, usage.cache_read_input_tokens, usage.output_tokens) == (
        18_000 - 16_384,
        16_384,
        25,
    )


# -- through the real app (in-process WSGI, replay engine, real qwen3 pipeline) ---------

REPO = Path(__file__).resolve().parents[2]
REPLAY = "<think>\nA greeting.\n</think>\n\nHi!"
TOOL_CALL = (
    '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls", "timeout": "5"}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def app_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    from pipeserve.loading import build_app_from_config

    config = tmp_path_factory.mktemp("anthropic") / "server.yaml"
    config.write_text(
        f"pipelines_dir: {REPO / 'pipelines'}\n"
        "server: {host: 127.0.0.1, port: 8080}\n"
        "models:\n"
        f"  - {{name: demo, source: 'demo:qwen3', pipeline: qwen3, engine: replay, replay: {{completion: {json.dumps(REPLAY)}}}}}\n"
        "endpoints:\n"
        "  - {route: /v1/messages, api: anthropic-messages}\n"
        "  - {route: /anthropic/v1/messages, api: anthropic-messages}\n"
    )
    app = build_app_from_config(config)
    with httpx.Client(transport=httpx.WSGITransport(app=app), base_url="http://test") as http:
        yield http


def test_app_streams_claude_code_request(app_client: httpx.Client) -> None:
    headers = {
        "anthropic-version": "2023-06-01",
        "anthropic-beta": META.headers["anthropic-beta"],
        "x-api-key": "k",
    }
    response = app_client.post("/v1/messages?beta=true", json=claude_code_body(), headers=headers)
    assert response.status_code == 200 and response.headers["content-type"].startswith(
        "text/event-stream"
    )
    events = anthropic_events(response.content)
    names = [name for name, _ in events if name != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert all(name == data["type"] for name, data in events)
    input_tokens = events[0][1]["message"]["usage"]["input_tokens"]
    assert input_tokens > 10_000  # the ~75 KB prompt, really rendered and counted
    counted = app_client.post(
        "/v1/messages/count_tokens?beta=true", json=claude_code_body(), headers=headers
    )
    assert counted.status_code == 200 and counted.json() == {"input_tokens": input_tokens}
    blocks = [
        data["content_block"]["type"] for name, data in events if name == "content_block_start"
    ]
    assert blocks == ["thinking", "text"]


def test_app_sdk_tool_round_trip_on_a_route_from_yaml(app_client: httpx.Client) -> None:
    sdk = anthropic.Anthropic(
        api_key="k", base_url="http://test/anthropic", max_retries=0, http_client=app_client
    )
    tools = [tool("Bash")]
    ask = [{"role": "user", "content": "list files"}]
    with sdk.messages.stream(
        model="demo",
        max_tokens=200,
        messages=ask,
        tools=tools,
        extra_body={"mock_response": TOOL_CALL},
    ) as stream:
        first = stream.get_final_message()
    use = first.content[-1]
    assert first.stop_reason == "tool_use" and use.type == "tool_use"
    assert use.name == "Bash" and use.input == {
        "command": "ls",
        "timeout": 5,
    }  # coerced to the schema
    history = [
        *ask,
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "a.txt"}],
        },
    ]
    second = sdk.messages.create(model="demo", max_tokens=64, messages=history, tools=tools)  # type: ignore[arg-type]
    assert [block.type for block in second.content] == ["text"]  # thinking was not asked for
    assert second.usage.input_tokens > first.usage.input_tokens


@pytest.mark.parametrize(
    ("body", "status", "error_type"),
    [
        (
            {"model": "demo", "messages": [{"role": "user", "content": "hi"}]},
            400,
            "invalid_request_error",
        ),
        (
            {"model": "nope", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
            404,
            "not_found_error",
        ),
        (
            {
                "model": "demo",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            },
            400,
            "invalid_request_error",
        ),
    ],
)
def test_app_errors_in_anthropic_shape(
    app_client: httpx.Client, body: dict[str, Any], status: int, error_type: str
) -> None:
    response = app_client.post("/v1/messages", json=body)
    assert response.status_code == status
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == error_type
