"""Responses reasoning summaries and the replayed stream of a stored response, read by the
openai SDK (its typed events, strictly validated, and its stream accumulator)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from pipeserve.api.openai_responses.protocol import OpenAIResponses
from pipeserve.api.openai_responses.replay import replay_events
from pipeserve.events import ContentDelta, Event, Finish, PromptReady, ReasoningDelta, Usage
from tests.api.helpers import Harness

EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
RUN: list[Event] = [
    PromptReady(20),
    ReasoningDelta("The user "),
    ReasoningDelta("greets me."),
    ContentDelta("Hello!"),
    Finish("stop"),
    Usage(20, 6, 0, 4),
]


def harness() -> Harness:
    return Harness(OpenAIResponses(), lambda ctx: list(RUN))


def stream(summary: str | None, **extra: Any) -> tuple[list[Any], Response]:
    reasoning = {"effort": "low", **({"summary": summary} if summary else {})}
    with harness().client.responses.stream(
        model="demo", input="hi", reasoning=reasoning, **extra
    ) as events:
        seen = list(events)
        final = events.get_final_response()
    for event in seen:
        EVENT.validate_python(event.model_dump(warnings=False))
    return seen, final


@pytest.mark.parametrize("summary", ["auto", "concise", "detailed"])
def test_summary_asked_sends_reasoning_as_summary(summary: str) -> None:
    events, final = stream(summary)
    kinds = [e.type for e in events]
    assert kinds[:6] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.delta",
    ]
    assert kinds[6:9] == [
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
        "response.output_item.done",
    ]
    assert not any(kind.startswith("response.reasoning_text") for kind in kinds)
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta")
    assert deltas == "The user greets me."
    reasoning = final.output[0]
    assert reasoning.type == "reasoning"
    assert [(p.type, p.text) for p in reasoning.summary] == [("summary_text", deltas)]
    assert reasoning.content is None
    assert final.reasoning and final.reasoning.summary == summary
    assert final.output_text == "Hello!"


def test_without_summary_reasoning_stays_content() -> None:
    events, final = stream(None)
    assert not any("summary" in e.type for e in events)
    reasoning = final.output[0]
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert reasoning.content and reasoning.content[0].text == "The user greets me."


def test_summary_with_encrypted_reasoning_round_trips() -> None:
    client = harness()
    first = client.client.responses.create(
        model="demo",
        input="hi",
        reasoning={"summary": "auto"},
        include=["reasoning.encrypted_content"],
        store=False,
    )
    reasoning = first.output[0]
    assert reasoning.type == "reasoning" and reasoning.encrypted_content
    # A stateless client sends the item back with only the sealed blob: its text returns.
    sealed = reasoning.encrypted_content
    sent = {"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": sealed}
    client.client.responses.create(
        model="demo", input=[{"role": "user", "content": "hi"}, sent, *later_turn(first)]
    )
    messages = client.requests[-1].messages
    assert messages[1].role == "assistant" and messages[1].reasoning == "The user greets me."


def later_turn(first: Response) -> list[dict[str, Any]]:
    message = first.output[1].model_dump(exclude_none=True)
    return [message, {"role": "user", "content": "and?"}]


def test_replayed_stream_rebuilds_the_response() -> None:
    harnessed = harness()
    raw = harnessed.client.responses.with_raw_response.create(
        model="demo", input="hi", reasoning={"summary": "auto"}, store=False
    )
    body = json.loads(raw.text)
    events = replay_events(body)
    for event in events:
        EVENT.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed" and events[-1]["response"] == body
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    summary = [e["delta"] for e in events if e["type"] == "response.reasoning_summary_text.delta"]
    assert text == "Hello!" and summary == ["The user greets me."]
    assert replay_events(body, starting_after=len(events) - 2) == events[-1:]
