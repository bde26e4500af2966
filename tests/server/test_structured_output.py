"""Structured output on the real demo model (random weights, temperature 1.0): every
answer must parse and validate, through each protocol's own SDK."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from anthropic import Anthropic
from openai import OpenAI
from pydantic import BaseModel

from tests.server.serverproc import REPO, running_server
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


# -- Responses -------------------------------------------------------------------------


def test_responses_json_schema_answers_all_validate(client: OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "ticket", "schema": SCHEMA, "strict": True}

    def ask(_: int) -> str | None:
        reply = client.responses.create(
            model="demo", input="File a ticket.", text={"format": fmt}, temperature=1.0,
            max_output_tokens=200, reasoning={"effort": "none"},
        )  # fmt: skip
        assert reply.status == "completed"
        return reply.output_text

    for text in sample_all(ask, SAMPLES):
        assert_valid(text)


def test_responses_parse_and_stream_populate_parsed(client: OpenAI) -> None:
    reply = client.responses.parse(
        model="demo", input="File a ticket.", text_format=Ticket, max_output_tokens=200,
        reasoning={"effort": "none"},
    )  # fmt: skip
    assert isinstance(reply.output_parsed, Ticket)
    with client.responses.stream(
        model="demo", input="File a ticket.", text_format=Ticket, max_output_tokens=200,
        reasoning={"effort": "none"},
    ) as stream:  # fmt: skip
        kinds = {event.type for event in stream}
        final = stream.get_final_response()
    assert "response.output_text.delta" in kinds
    assert isinstance(final.output_parsed, Ticket)


def test_regex_and_lark_grammars(client: OpenAI) -> None:
    regex = {"type": "grammar", "syntax": "regex", "definition": "[a-z]{3}-[0-9]{2}"}
    reply = client.responses.create(
        model="demo", input="A code.", text={"format": regex}, max_output_tokens=40,  # type: ignore[typeddict-item]
        reasoning={"effort": "none"},
    )  # fmt: skip
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", reply.output_text)
    lark = 'start: "yes" | "no" | NUM\nNUM: /[1-9][0-9]{0,2}/'
    chat = client.chat.completions.create(
        model="demo", messages=ASK, max_tokens=40, **NO_THINKING,
        response_format={"type": "grammar", "syntax": "lark", "definition": lark},  # type: ignore[arg-type,typeddict-item]
    )  # fmt: skip
    assert re.fullmatch(r"yes|no|[1-9][0-9]{0,2}", chat.choices[0].message.content or "")


# -- Anthropic -------------------------------------------------------------------------


class Pick(BaseModel):
    """Only enums and booleans: the SDK's transform_schema drops length and range bounds."""

    status: Literal["open", "closed"]
    urgent: bool
    tags: list[Literal["x", "y"]]


def test_anthropic_output_format_answers_all_validate(demo_server: str) -> None:
    claude = Anthropic(base_url=demo_server, api_key="test", max_retries=0, timeout=300)

    def ask(_: int) -> str | None:
        reply = claude.messages.create(
            model="demo", max_tokens=200, messages=ASK,  # type: ignore[arg-type]
            output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
        )  # fmt: skip
        assert reply.stop_reason == "end_turn"
        return "".join(b.text for b in reply.content if b.type == "text")

    for text in sample_all(ask, SAMPLES):
        assert_valid(text)
    parsed = claude.messages.parse(
        model="demo",
        max_tokens=200,
        messages=ASK,
        output_format=Pick,  # type: ignore[arg-type]
    )
    assert isinstance(parsed.parsed_output, Pick)
    beta = httpx.post(
        f"{demo_server}/v1/messages",
        json={
            "model": "demo",
            "max_tokens": 200,
            "messages": ASK,
            "output_format": {"type": "json_schema", "schema": SCHEMA},
        },
        timeout=300,
    ).json()
    assert_valid(beta["content"][-1]["text"])


# -- YAML defaults ---------------------------------------------------------------------

DEFAULTS_CONFIG = """
pipelines_dir: {repo}/pipelines
models:
  - name: ticketer
    source: demo:qwen3
    pipeline: qwen3
    options: {{max_batch: 4, default_max_tokens: 120}}
    output_format:
      json_schema: {schema}
endpoints:
  - {{route: /v1/chat/completions, api: openai-chat}}
  - route: /codes/v1/chat/completions
    api: openai-chat
    output_format: {{regex: "[A-Z]{{2}}[0-9]{{4}}"}}
"""


def test_yaml_default_output_format(tmp_path: Path) -> None:
    config = tmp_path / "defaults.yaml"
    config.write_text(DEFAULTS_CONFIG.format(repo=REPO, schema=json.dumps(SCHEMA)))
    with running_server(config) as base:
        model_default = OpenAI(base_url=f"{base}/v1", api_key="t", max_retries=0, timeout=300)
        reply = model_default.chat.completions.create(
            model="ticketer", messages=ASK, max_tokens=200, **NO_THINKING
        )
        assert_valid(reply.choices[0].message.content)
        route = OpenAI(base_url=f"{base}/codes/v1", api_key="t", max_retries=0, timeout=300)
        reply = route.chat.completions.create(
            model="ticketer", messages=ASK, max_tokens=40, **NO_THINKING
        )
        assert re.fullmatch(r"[A-Z]{2}[0-9]{4}", reply.choices[0].message.content or "")
        # A client's own format still wins over the defaults.
        own = route.chat.completions.parse(
            model="ticketer", messages=ASK, response_format=Ticket, max_tokens=200, **NO_THINKING
        )
        assert isinstance(own.choices[0].message.parsed, Ticket)
