"""Ollama's API (/api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version)
with the official `ollama` Python client, on a real server: replay models for exact
text, the MLX demo model for real generation."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest

pytestmark = pytest.mark.server

HI = [{"role": "user", "content": "hi"}]
ANSWER = "Hello! How can I help you today?"
THOUGHT = "The user greets me."
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def client(replay_server: str) -> ollama.Client:
    return ollama.Client(host=replay_server)


def scripted(base: str, completion: str) -> ollama.Client:
    """A client whose requests make the replay model write `completion`."""
    return ollama.Client(host=base, headers={"X-Mock-Response": json.dumps(completion)})


def test_chat_answer_thinking_and_counts(client: ollama.Client) -> None:
    reply = client.chat(model="replay-qwen3", messages=HI)
    assert reply.message.role == "assistant" and reply.message.content == ANSWER
    assert reply.message.thinking == THOUGHT
    assert reply.done is True and reply.done_reason == "stop" and reply.model == "replay-qwen3"
    assert reply.prompt_eval_count and reply.prompt_eval_count > 0
    assert reply.eval_count and reply.eval_count > 0
    assert isinstance(reply.total_duration, int) and reply.total_duration > 0
    assert reply.created_at is not None and reply.created_at.endswith("Z")


def test_chat_stream_is_ndjson_and_adds_up(client: ollama.Client) -> None:
    parts = list(client.chat(model="replay-qwen3:latest", messages=HI, stream=True))
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    assert "".join(p.message.content or "" for p in parts) == ANSWER
    assert "".join(p.message.thinking or "" for p in parts) == THOUGHT
    assert parts[-1].eval_count == client.chat(model="replay-qwen3", messages=HI).eval_count


def test_think_false_closes_the_think_block_in_the_prompt(client: ollama.Client) -> None:
    default = client.chat(model="replay-qwen3", messages=HI).prompt_eval_count or 0
    off = client.chat(model="replay-qwen3", messages=HI, think=False).prompt_eval_count or 0
    assert off > default


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_carry_arguments_as_objects(replay_server: str, stream: bool) -> None:
    client = scripted(replay_server, CALL)
    parts = client.chat(model="replay-qwen3", messages=HI, tools=[WEATHER], stream=stream)
    replies = list(parts) if stream else [parts]
    calls = [c for r in replies for c in r.message.tool_calls or []]
    assert len(calls) == 1
    assert calls[0].function.name == "get_weather"
    assert calls[0].function.arguments == {"city": "Paris"}
    assert replies[-1].done_reason == "stop"
    # the call and its result go back as the next turn's history
    history = [
        *HI,
        {"role": "assistant", "content": "", "tool_calls": [calls[0].model_dump()]},
        {"role": "tool", "content": '{"temp": 20}', "tool_name": "get_weather"},
    ]
    follow = scripted(replay_server, "It is 20 degrees.").chat(
        model="replay-qwen3", messages=history, tools=[WEATHER]
    )
    assert follow.message.content == "It is 20 degrees."


def test_options_num_predict_stop_and_seed(replay_server: str) -> None:
    client = scripted(replay_server, "one two three four five six seven")
    cut = client.chat(model="replay-qwen3", messages=HI, options={"num_predict": 3})
    assert cut.done_reason == "length" and cut.eval_count == 3
    stopped = client.chat(
        model="replay-qwen3",
        messages=HI,
        options={"stop": ["four"], "temperature": 0, "top_p": 0.9, "top_k": 20, "seed": 1},
    )
    assert stopped.message.content == "one two three " and stopped.done_reason == "stop"


def test_generate_templated_and_raw(client: ollama.Client) -> None:
    reply = client.generate(model="replay-qwen3", prompt="hi", system="Be brief.")
    assert reply.response == ANSWER and reply.thinking == THOUGHT and reply.done
    raw = client.generate(model="replay-qwen3", prompt="<|im_start|>user\nhi", raw=True)
    assert raw.response.startswith("<think>\n") and raw.response.endswith(ANSWER)
    assert raw.thinking is None
    streamed = list(client.generate(model="replay-qwen3", prompt="hi", stream=True))
    assert "".join(p.response for p in streamed) == ANSWER and streamed[-1].done


def test_catalog_routes(client: ollama.Client, replay_server: str) -> None:
    names = [m.model for m in client.list().models]
    assert "replay-qwen3" in names and "replay-gpt-oss" in names
    shown = client.show("replay-qwen3")
    assert shown.capabilities is not None
    assert {"completion", "tools", "thinking"} <= set(shown.capabilities)
    assert shown.details is not None and shown.details.family == "qwen3"
    assert shown.template and "<|im_start|>" in shown.template
    assert shown.modelinfo and shown.modelinfo["general.architecture"] == "qwen3"
    assert "replay-glm" in [m.model for m in client.ps().models]
    version = httpx.get(f"{replay_server}/api/version", timeout=10)
    assert version.status_code == 200 and version.json()["version"]


@pytest.mark.parametrize(
    ("call", "status", "words"),
    [
        (lambda c: c.chat(model="nope", messages=HI), 404, "nope"),
        (lambda c: c.show("nope"), 404, "not found"),
        (lambda c: c.generate(model="replay-kimi", prompt="x", suffix="y"), 400, "suffix"),
        (lambda c: c.chat(model="replay-qwen3", messages=HI, think="max"), 400, "think"),  # type: ignore[arg-type]
        (
            lambda c: c.chat(
                model="replay-qwen3",
                messages=[{"role": "user", "content": "x", "images": ["aGk="]}],
            ),
            400,
            "images",
        ),
    ],
)
def test_errors_are_ollama_shaped(
    client: ollama.Client, call: object, status: int, words: str
) -> None:
    with pytest.raises(ollama.ResponseError) as error:
        call(client)  # type: ignore[operator]
    assert error.value.status_code == status and words in error.value.error


def test_raw_bodies_the_client_would_not_send(replay_server: str) -> None:
    """A malformed body (the client validates its own) is a 400 in Ollama's shape."""
    for body, words in (
        ({"model": "replay-qwen3", "messages": HI, "format": "yaml"}, "format"),
        ({"model": "replay-qwen3", "messages": []}, "messages"),
        (
            {"model": "replay-qwen3", "messages": HI, "options": {"temperature": "hot"}},
            "temperature",
        ),
    ):
        reply = httpx.post(f"{replay_server}/api/chat", json=body, timeout=10)
        assert reply.status_code == 400 and words in reply.json()["error"]
        assert reply.headers["content-type"].startswith("application/json")


@pytest.mark.mlx
def test_real_generation(demo_server: str) -> None:
    client = ollama.Client(host=demo_server)
    options = {"num_predict": 5, "temperature": 0}
    first = client.chat(model="demo", messages=HI, options=options, think=False)
    second = client.chat(model="demo", messages=HI, options=options, think=False, stream=True)
    parts = list(second)
    assert "".join(p.message.content or "" for p in parts) == first.message.content
    assert first.eval_count == parts[-1].eval_count and 0 < (first.eval_count or 0) <= 5
    assert first.done_reason in ("stop", "length")
    generated = client.generate(
        model="demo", prompt="The sky is", raw=True, options=options, logprobs=True, top_logprobs=2
    )
    assert generated.eval_count and generated.eval_count <= 5 and generated.done
    logprobs = generated.logprobs or []
    assert "".join(lp.token for lp in logprobs) == generated.response
    assert len(logprobs) == generated.eval_count and all(lp.logprob <= 0 for lp in logprobs)
    assert all(len(lp.top_logprobs or []) == 2 for lp in logprobs)


@pytest.mark.mlx
def test_format_schema_is_enforced(demo_server: str) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    reply = ollama.Client(host=demo_server).chat(
        model="demo", messages=HI, format=schema, think=False, options={"num_predict": 40}
    )
    assert reply.done_reason == "stop"
    assert json.loads(reply.message.content or "") in ({"ok": True}, {"ok": False})
