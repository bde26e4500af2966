"""Every tool-call family of issue 36 through a real server (configs/replay-families.yaml,
`pipeline: auto`) and the official openai and anthropic SDKs, streaming and not: the
family's own markup replayed through its demo tokenizer gives the same reasoning, text
and calls on Chat Completions, Messages and Responses. Scenarios (tests/families.py):
one call, two calls in a turn, a call after text, a call written inside reasoning (stays
reasoning), malformed call markup (the text as written, finish "stop"), and a stop
string that occurs inside a call's arguments (the call is kept whole)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from anthropic import Anthropic
from openai import OpenAI

from tests.families import CALL, CALL_SCENARIOS, COMPLETIONS, HAS_REASONING, REASONING, TIME_CALL
from tests.sdk_answers import Answer as SdkAnswer
from tests.sdk_answers import chat_answer, messages_answer, responses_answer
from tests.server.serverproc import REPO, running_server

pytestmark = pytest.mark.server

FAMILIES = sorted(CALL_SCENARIOS)
PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TIME_PARAMS = {"type": "object", "properties": {"tz": {"type": "string"}}}
FUNCTIONS = [("get_weather", PARAMS), ("get_time", TIME_PARAMS)]
ASK = [{"role": "user", "content": "Weather in Paris, and the time?"}]


@dataclass
class Answer:
    reasoning: str = ""
    text: str = ""
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    ended: str = ""  # "tools" or "stop"


def ended(read: SdkAnswer, words: dict[str, str]) -> Answer:
    """The SDK's answer with its protocol's finish word as "tools" or "stop"."""
    return Answer(read.reasoning, read.text, read.calls, words.get(read.finish, read.finish))


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    with running_server(REPO / "configs" / "replay-families.yaml") as url:
        yield url


def chat(base: str, family: str, raw: str, stream: bool, stop: list[str] | None) -> Answer:
    client = OpenAI(base_url=f"{base}/v1", api_key="t", max_retries=0)
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in FUNCTIONS]
    kw: dict[str, Any] = {"model": f"replay-{family}", "messages": ASK, "tools": tools}
    kw["extra_body"] = {"mock_response": raw}
    if stop:
        kw["stop"] = stop
    return ended(chat_answer(client, kw, stream), {"tool_calls": "tools", "stop": "stop"})


def messages(base: str, family: str, raw: str, stream: bool, stop: list[str] | None) -> Answer:
    client = Anthropic(base_url=base, api_key="t", max_retries=0)
    tools = [{"name": n, "input_schema": p} for n, p in FUNCTIONS]
    kw: dict[str, Any] = {
        "model": f"replay-{family}", "max_tokens": 256, "messages": ASK, "tools": tools,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "extra_body": {"mock_response": raw},
    }  # fmt: skip
    if stop:
        kw["stop_sequences"] = stop
    words = {"tool_use": "tools", "end_turn": "stop", "stop_sequence": "stop"}
    return ended(messages_answer(client, kw, stream), words)


def responses(base: str, family: str, raw: str, stream: bool, stop: list[str] | None) -> Answer:
    client = OpenAI(base_url=f"{base}/v1", api_key="t", max_retries=0)
    tools = [
        {"type": "function", "name": n, "parameters": p, "strict": False} for n, p in FUNCTIONS
    ]
    kw: dict[str, Any] = {"model": f"replay-{family}", "input": ASK[0]["content"], "tools": tools}
    kw["extra_body"] = {"mock_response": raw}
    read = responses_answer(client, kw, stream)
    assert read.finish == "completed"
    return ended(read, {"completed": "tools" if read.calls else "stop"})


ASKERS = {"chat": chat, "messages": messages, "responses": responses}


def answers(base: str, family: str, raw: str, stop: list[str] | None = None) -> dict[str, Answer]:
    """The answer through each protocol, streaming and not (Responses has no stop)."""
    got = {}
    for name, ask in ASKERS.items():
        if stop and name == "responses":
            continue
        for stream in (False, True):
            got[f"{name}-{'stream' if stream else 'json'}"] = ask(base, family, raw, stream, stop)
    return got


def check(got: dict[str, Answer], expected: Answer) -> None:
    for how, answer in got.items():
        assert answer == expected, (how, answer)


def reasoning_of(family: str, text: str) -> str:
    return text if HAS_REASONING[family] else ""


@pytest.mark.parametrize("family", FAMILIES)
def test_one_call(base: str, family: str) -> None:
    prefix = {"deepseek": "Need it."}.get(family, "")
    check(answers(base, family, CALL_SCENARIOS[family]["single"]),
          Answer(prefix, "", [CALL], "tools"))  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_two_calls_in_one_turn(base: str, family: str) -> None:
    prefix = {"deepseek": "Need both."}.get(family, "")
    check(answers(base, family, CALL_SCENARIOS[family]["two"]),
          Answer(prefix, "", [CALL, TIME_CALL], "tools"))  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_a_call_after_text(base: str, family: str) -> None:
    check(answers(base, family, COMPLETIONS[family]),
          Answer(reasoning_of(family, REASONING), "Sure.", [CALL], "tools"))  # fmt: skip


@pytest.mark.parametrize("family", [f for f in FAMILIES if "in_reasoning" in CALL_SCENARIOS[f]])
def test_a_call_inside_reasoning_stays_reasoning(base: str, family: str) -> None:
    raw = CALL_SCENARIOS[family]["in_reasoning"]
    got = answers(base, family, raw)
    inner = raw.split("I could write ", 1)[1].split(" here.", 1)[0]
    check(got, Answer(f"I could write {inner} here.", "Done.", [], "stop"))


@pytest.mark.parametrize("family", FAMILIES)
def test_malformed_call_markup_is_the_text_it_was(base: str, family: str) -> None:
    raw = CALL_SCENARIOS[family]["malformed"]
    text = raw.removeprefix("</think>")  # deepseek: the prompt opened the think block
    check(answers(base, family, raw), Answer("", text, [], "stop"))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_stop_string_inside_arguments_keeps_the_call(base: str, family: str) -> None:
    prefix = {"deepseek": "Need it."}.get(family, "")
    got = answers(base, family, CALL_SCENARIOS[family]["single"], stop=["Paris"])
    check(got, Answer(prefix, "", [CALL], "tools"))


STREAMED = {**{f: CALL_SCENARIOS[f]["single"] for f in FAMILIES}, "gemma": (
    '```json\n{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}\n```'
)}  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_arguments_stream_in_fragments(base: str, family: str) -> None:
    """Chat streaming: the call's arguments arrive in several chunks as they are generated
    (not buffered to the end of the call), and join to the complete arguments."""
    client = OpenAI(base_url=f"{base}/v1", api_key="t", max_retries=0)
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in FUNCTIONS]
    stream = client.chat.completions.create(
        model=f"replay-{family}", messages=ASK, tools=tools, stream=True,
        extra_body={"mock_response": STREAMED[family]},
    )  # fmt: skip
    fragments = [
        call.function.arguments
        for chunk in stream
        if chunk.choices
        for call in chunk.choices[0].delta.tool_calls or []
        if call.function is not None and call.function.arguments
    ]
    assert len(fragments) >= 3, fragments
    assert json.loads("".join(fragments)) == CALL[1]
