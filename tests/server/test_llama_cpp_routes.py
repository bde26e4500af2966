"""llama.cpp's routes (`api: llama-cpp` on `/`: /tokenize, /detokenize, /infill) and
fill-in-the-middle on Completions (openai SDK) and Ollama's /api/generate (ollama
client), on real servers: replay models for exact text and four real tokenizers, the
MLX demo model for real generation."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import ollama
import openai
import pytest

from tests.engine.weights.test_demo_models import TEXTS
from tests.engine.weights.test_gguf_convert import STRINGS

pytestmark = pytest.mark.server

FAMILIES = ("qwen3", "gpt-oss", "glm", "kimi")
CORPUS = [*STRINGS, *TEXTS]
PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"
CODER = "<|fim_prefix|>{}<|fim_suffix|>{}<|fim_middle|>"


def post(base: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=60)


def ok(base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = post(base, path, body)
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenize_and_detokenize_round_trip_the_corpus(
    replay_server: str, family: str, demo_tokenizer: Callable[[str], Any]
) -> None:
    hf = demo_tokenizer(family)._tokenizer
    model = f"replay-{family}"
    for text in CORPUS:
        tokens = ok(replay_server, "/tokenize", {"model": model, "content": text})["tokens"]
        assert tokens == hf.encode(text, add_special_tokens=False), text
        assert ok(replay_server, "/detokenize", {"model": model, "tokens": tokens}) == {
            "content": text
        }
        body = {"model": model, "content": text, "with_pieces": True}
        pieces = ok(replay_server, "/tokenize", body)["tokens"]
        assert [p["id"] for p in pieces] == tokens
        raw = b"".join(
            p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"])
            for p in pieces
        )
        assert raw == text.encode(), text


def test_parse_special_false_reads_special_spellings_as_text(replay_server: str) -> None:
    text = "<|im_start|>user\nhi<|im_end|>"
    body = {"model": "replay-qwen3", "content": text}
    specials = ok(replay_server, "/tokenize", body)["tokens"]
    plain = ok(replay_server, "/tokenize", body | {"parse_special": False})["tokens"]
    assert 151644 in specials and 151644 not in plain and len(plain) > len(specials)
    back = ok(replay_server, "/detokenize", {"model": "replay-qwen3", "tokens": plain})
    assert back["content"] == text


def test_tokenized_messages_are_the_prompt_chat_sends(replay_server: str) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    client = openai.OpenAI(base_url=f"{replay_server}/v1", api_key="x", max_retries=0)
    for extra in ({}, {"tools": tools}):
        body = {"model": "replay-qwen3", "messages": messages, **extra}
        tokens = ok(replay_server, "/tokenize", body)["tokens"]
        reply = client.chat.completions.create(**body)  # type: ignore[call-overload]
        assert reply.usage is not None and len(tokens) == reply.usage.prompt_tokens
        text = ok(replay_server, "/detokenize", {"model": "replay-qwen3", "tokens": tokens})
        assert text["content"].startswith("<|im_start|>system\nBe brief.")
        assert text["content"].endswith("<|im_start|>assistant\n")
        assert ("calc" in text["content"]) == bool(extra)


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"model": "replay-qwen3"}, 400, "content"),
        ("/tokenize", {"model": "replay-qwen3", "content": "a", "messages": []}, 400, "content"),
        ("/tokenize", {"content": "a"}, 400, "model"),  # four models on this route
        ("/tokenize", {"model": "nope", "content": "a"}, 404, "model"),
        ("/tokenize", {"model": "replay-qwen3", "content": 5}, 400, "content"),
        ("/tokenize", {"model": "replay-qwen3", "messages": []}, 400, "messages"),
        ("/tokenize", {"model": "replay-qwen3", "messages": "hi"}, 400, "messages"),
        (
            "/tokenize",
            {
                "model": "replay-qwen3",
                "messages": [{"role": "user", "content": "a"}],
                "add_special": True,
            },
            400,
            "add_special",
        ),  # fmt: skip
        (
            "/tokenize",
            {"model": "replay-qwen3", "content": "a", "with_pieces": "yes"},
            400,
            "with_pieces",
        ),  # fmt: skip
        ("/detokenize", {"model": "replay-qwen3", "tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {"model": "replay-qwen3", "tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"model": "replay-qwen3", "tokens": ["a"]}, 400, "tokens[0]"),
        ("/detokenize", {"model": "replay-qwen3", "tokens": 3}, 400, "tokens"),
        ("/infill", {"model": "replay-kimi", "input_prefix": "a"}, 400, "model"),  # no FIM
        ("/infill", {"model": "replay-qwen3", "input_prefix": 1}, 400, "input_prefix"),
        (
            "/infill",
            {"model": "replay-qwen3", "input_extra": [{"text": 2}]},
            400,
            "input_extra[0].text",
        ),  # fmt: skip
        ("/infill", {"model": "replay-qwen3", "n_predict": 0}, 400, "n_predict"),
        ("/infill", {"model": "replay-qwen3", "n_probs": 3}, 400, "n_probs"),
        ("/infill", {"model": "replay-qwen3", "temperature": -1}, 400, "temperature"),
        ("/infill", {"model": "replay-qwen3", "stop": [""]}, 400, "stop[0]"),
        ("/infill", [], 400, None),
    ],
)
def test_bad_input_is_a_4xx_in_llama_cpp_s_shape_naming_the_field(
    replay_server: str, path: str, body: Any, status: int, param: str | None
) -> None:
    reply = httpx.post(f"{replay_server}{path}", json=body, timeout=30)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["code"] == status and error["param"] == param and error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_infill_streams_what_it_answers(replay_server: str) -> None:
    body = {
        "model": "replay-qwen3",
        "input_prefix": "def f(",
        "input_suffix": "):\n    pass\n",
        "input_extra": [{"filename": "util.py", "text": "X = 1\n"}],
        "mock_response": "a, b",
    }
    answer = ok(replay_server, "/infill", body)
    assert answer["content"] == "a, b" and answer["stop"] is True
    assert answer["stop_type"] == "eos" and answer["tokens_predicted"] == 3
    assert answer["prompt"] == (
        "<|repo_name|>myproject\n<|file_sep|>util.py\nX = 1\n<|file_sep|>filename\n"
        "<|fim_prefix|>def f(<|fim_suffix|>):\n    pass\n<|fim_middle|>"
    )
    with httpx.stream("POST", f"{replay_server}/infill", json=body | {"stream": True}) as reply:
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines]
    assert "".join(c["content"] for c in chunks) == "a, b"
    assert [c["stop"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1]["tokens_evaluated"] == answer["tokens_evaluated"]
    limited = ok(replay_server, "/infill", body | {"n_predict": 2})
    assert limited["stop_type"] == "limit" and limited["content"] == "a,"
    word = ok(replay_server, "/infill", body | {"stop": [" b"]})
    assert (word["stop_type"], word["stopping_word"], word["content"]) == ("word", " b", "a,")


def test_completions_suffix_on_replay(replay_server: str) -> None:
    client = openai.OpenAI(base_url=f"{replay_server}/v1", api_key="x", max_retries=0)
    fields: dict[str, Any] = {"model": "replay-qwen3", "prompt": PREFIX, "suffix": SUFFIX}
    fields["extra_body"] = {"mock_response": "return a + b"}
    reply = client.completions.create(max_tokens=20, **fields)
    assert reply.choices[0].text == "return a + b"
    streamed = client.completions.create(max_tokens=20, stream=True, **fields)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == "return a + b"
    layout = ok(replay_server, "/tokenize", {"model": "replay-qwen3", "content": ""})
    assert layout == {"tokens": []}
    expected = ok(
        replay_server,
        "/tokenize",
        {"model": "replay-qwen3", "content": CODER.format(PREFIX, SUFFIX)},
    )["tokens"]
    assert reply.usage is not None and reply.usage.prompt_tokens == len(expected)
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(max_tokens=5, echo=True, **fields)
    assert error.value.body["param"] == "echo"  # type: ignore[index]


@pytest.mark.mlx
def test_fill_in_the_middle_generates_from_the_documented_layout(
    demo_server: str, demo_tokenizer: Callable[[str], Any]
) -> None:
    """Real generation: `suffix` on Completions and Ollama, and /infill, give the greedy
    answer of the documented (resp. llama.cpp's) layout sent as token ids."""
    hf = demo_tokenizer("qwen3")._tokenizer
    client = openai.OpenAI(base_url=f"{demo_server}/v1", api_key="x", max_retries=0)
    greedy: dict[str, Any] = {"model": "demo", "max_tokens": 8, "temperature": 0}
    fim = client.completions.create(prompt=PREFIX, suffix=SUFFIX, **greedy)
    layout = hf.encode(CODER.format(PREFIX, SUFFIX))
    by_ids = client.completions.create(prompt=layout, **greedy)
    assert fim.choices[0].finish_reason == "length"  # 8 tokens, no FIM end token
    assert fim.choices[0].text == by_ids.choices[0].text != ""
    generated = ollama.Client(host=demo_server).generate(
        model="demo", prompt=PREFIX, suffix=SUFFIX, options={"temperature": 0, "num_predict": 8}
    )
    assert generated.response == fim.choices[0].text
    # /infill: no model field (the route serves one), llama.cpp's repo-level layout
    infill = ok(demo_server, "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX,
                                         "n_predict": 8, "temperature": 0})  # fmt: skip
    repo = "<|repo_name|>myproject\n<|file_sep|>filename\n" + CODER.format(PREFIX, SUFFIX)
    assert infill["prompt"] == repo and infill["model"] == "demo"
    by_repo_ids = client.completions.create(prompt=hf.encode(repo), **greedy)
    assert infill["content"] == by_repo_ids.choices[0].text
    tokens = ok(demo_server, "/tokenize", {"content": "hi"})["tokens"]  # no model: the only one
    assert tokens == hf.encode("hi")


def test_ollama_suffix_on_replay(replay_server: str) -> None:
    client = ollama.Client(host=replay_server, headers={"X-Mock-Response": "return a + b"})
    answer = client.generate(model="replay-qwen3", prompt=PREFIX, suffix=SUFFIX)
    assert answer.response == "return a + b" and answer.done_reason == "stop"
    streamed = client.generate(model="replay-qwen3", prompt="", suffix=SUFFIX, stream=True)
    assert "".join(part.response or "" for part in streamed) == "return a + b"
    with pytest.raises(ollama.ResponseError) as error:
        client.generate(model="replay-qwen3", prompt=PREFIX, suffix=SUFFIX, system="Be terse.")
    assert error.value.status_code == 400 and "system" in error.value.error
    shown = client.show("replay-qwen3").capabilities or []
    assert "insert" in shown and "insert" not in (client.show("replay-kimi").capabilities or [])
