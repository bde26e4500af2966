"""Structured output on the real demo model (random weights, temperature 1.0): every
answer must parse and validate, through each protocol's own SDK."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.server.structured_cases import (
    SAMPLES,
    SCHEMA,
    Ticket,
    assert_valid,
    sample_all,
    wait_idle,
)

pytestmark = [pytest.mark.server, pytest.mark.mlx]

ASK = [{"role": "user", "content": "File a ticket."}]
NO_THINKING: dict[str, Any] = {"reasoning_effort": "none"}


@pytest.fixture(scope="module")
def client(demo_server: str) -> OpenAI:
    return OpenAI(base_url=f"{demo_server}/v1", api_key="test", max_retries=0, timeout=300)


def test_chat_json_schema_answers_all_validate(client: OpenAI) -> None:
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "ticket", "schema": SCHEMA, "strict": True},
    }

    def ask(_: int) -> str | None:
        reply = client.chat.completions.create(
            model="demo", messages=ASK, response_format=fmt, temperature=1.0, max_tokens=200,
            **NO_THINKING,
        )  # fmt: skip
        assert reply.choices[0].finish_reason == "stop"
        assert reply.choices[0].message.refusal is None
        return reply.choices[0].message.content

    answers = sample_all(ask, SAMPLES)
    for text in answers:
        assert_valid(text)
    assert len(set(answers)) > 1  # sampled, not one forced answer


def test_chat_parse_populates_parsed(client: OpenAI) -> None:
    reply = client.chat.completions.parse(
        model="demo", messages=ASK, response_format=Ticket, max_tokens=200, **NO_THINKING
    )
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Ticket)
    assert parsed.model_dump() == assert_valid(reply.choices[0].message.content)


def test_chat_stream_helper_populates_parsed(client: OpenAI) -> None:
    with client.chat.completions.stream(
        model="demo", messages=ASK, response_format=Ticket, max_tokens=200, **NO_THINKING
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert len(deltas) > 3  # the JSON arrived in pieces
    assert isinstance(final.choices[0].message.parsed, Ticket)


def test_chat_json_object_is_an_object(client: OpenAI) -> None:
    reply = client.chat.completions.create(
        model="demo", messages=ASK, response_format={"type": "json_object"}, max_tokens=40,
        **NO_THINKING,
    )  # fmt: skip
    text = reply.choices[0].message.content or ""
    # A random model rarely closes a free object before max_tokens: the text must still
    # be a valid JSON object prefix, and when it stops, a whole object.
    assert text.startswith("{")
    if reply.choices[0].finish_reason == "stop":
        import json

        assert isinstance(json.loads(text), dict)


def test_schema_that_does_not_compile_is_a_400_naming_the_field(
    client: OpenAI, demo_server: str
) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integr"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="demo", messages=ASK, response_format=bad)
    body: Any = info.value.body
    assert body["param"] == "response_format.json_schema.schema"
    assert "integr" in body["message"]
    assert wait_idle(demo_server) == 0


def test_cancelled_constrained_stream_leaves_no_slot(client: OpenAI, demo_server: str) -> None:
    fmt = {"type": "json_object"}
    with httpx.stream(
        "POST",
        f"{demo_server}/v1/chat/completions",
        json={
            "model": "demo",
            "messages": ASK,
            "stream": True,
            "max_tokens": 2000,
            "response_format": fmt,
            "reasoning_effort": "none",
        },
        timeout=60,
    ) as reply:
        for i, _ in enumerate(reply.iter_lines()):
            if i > 6:
                break  # leave mid-stream
    assert wait_idle(demo_server) == 0
    # The batch still serves constrained requests.
    again = client.chat.completions.parse(
        model="demo", messages=ASK, response_format=Ticket, max_tokens=200, **NO_THINKING
    )
    assert isinstance(again.choices[0].message.parsed, Ticket)
