"""Stored Responses through the openai SDK against real gunicorn servers (replay engine).

One store file in a temporary folder serves two servers in turn: a first server stores
a response and stops; the second (2 workers, the one the tests use) must still find it.
Whether the model saw an earlier turn is checked by prompt token counts: a continued
request costs exactly what the same conversation sent in full costs.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.server.scenarios import QWEN3, WEATHER_TOOL_SCHEMA
from tests.server.serverproc import pipeserve_command
from tests.server.store_servers import Servers, store_config

pytestmark = pytest.mark.server

MODEL = QWEN3.model
TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER_TOOL_SCHEMA}]
ITEM = TypeAdapter(ResponseItem)
EVENT = TypeAdapter(ResponseStreamEvent)


def create(client: OpenAI, completion: str = QWEN3.reasoning, **fields: Any) -> Response:
    return client.responses.create(model=MODEL, extra_body={"mock_response": completion}, **fields)


def dump(items: list[Any]) -> list[dict[str, Any]]:
    return [item.model_dump(exclude_none=True) for item in items]


def test_stored_response_is_retrieved(servers: Servers) -> None:
    first = create(servers.client, input="Say hello", metadata={"k": "v"})
    assert first.store is True
    again = servers.client.responses.retrieve(first.id)
    Response.model_validate(again.model_dump())  # the SDK's own model, strictly
    assert again.model_dump() == first.model_dump()
    assert [item.type for item in again.output] == ["reasoning", "message"]


def test_a_restart_keeps_stored_responses(servers: Servers) -> None:
    before = servers.before_restart
    again = servers.client.responses.retrieve(before.id)
    assert again.output_text == before.output_text == "Hello there!"
    assert again.output[0].id == before.output[0].id


def test_previous_response_id_continues_the_conversation(servers: Servers) -> None:
    client = servers.client
    first = create(client, input="My name is Ada.", instructions="Answer briefly.")
    second = create(client, input="What is my name?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    # The same conversation sent in full, without the first turn's instructions (they are
    # not carried over): the prompt must be the same, token for token.
    history = [
        {"role": "user", "content": "My name is Ada."},
        *dump(first.output),
        {"role": "user", "content": "What is my name?"},
    ]
    full = create(client, input=history, store=False)
    assert second.usage.input_tokens == full.usage.input_tokens
    alone = create(client, input="What is my name?", store=False)
    assert second.usage.input_tokens > alone.usage.input_tokens
    # A chain of three: the third turn sees both earlier ones.
    third = create(client, input="And again?", previous_response_id=second.id)
    history += [*dump(second.output), {"role": "user", "content": "And again?"}]
    assert third.usage.input_tokens == create(client, input=history, store=False).usage.input_tokens


def test_item_references_to_reasoning_and_message_resolve(servers: Servers) -> None:
    client = servers.client
    first = create(client, input="Say hello")
    reasoning, message = first.output
    assert reasoning.type == "reasoning" and message.type == "message"
    turn = {"role": "user", "content": "Again, please."}
    by_reference = create(
        client,
        input=[
            {"role": "user", "content": "Say hello"},
            {"type": "item_reference", "id": reasoning.id},
            {"type": "item_reference", "id": message.id},
            turn,
        ],
    )
    in_full = create(
        client, input=[{"role": "user", "content": "Say hello"}, *dump(first.output), turn]
    )
    assert by_reference.usage.input_tokens == in_full.usage.input_tokens
    listed = client.responses.input_items.list(by_reference.id, order="asc")
    assert [item.id for item in listed.data][1:3] == [reasoning.id, message.id]


def test_unknown_ids_are_protocol_errors_naming_them(servers: Servers) -> None:
    client = servers.client
    with pytest.raises(openai.NotFoundError) as missing_item:
        create(client, input=[{"type": "item_reference", "id": "msg_nope"}])
    assert "msg_nope" in missing_item.value.message
    with pytest.raises(openai.BadRequestError) as missing_previous:
        create(client, input="hi", previous_response_id="resp_nope")
    body = missing_previous.value.body
    assert isinstance(body, dict)
    assert body["code"] == "previous_response_not_found"
    assert body["param"] == "previous_response_id" and "resp_nope" in body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")


def test_delete_then_get_is_a_404(servers: Servers) -> None:
    client = servers.client
    first = create(client, input="Forget me")
    later = create(client, input="Later", previous_response_id=first.id)
    deleted = client.responses.with_raw_response.delete(first.id)
    assert json.loads(deleted.text) == {
        "id": first.id,
        "object": "response.deleted",
        "deleted": True,
    }
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(first.id)
    assert first.id in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    # Continuing after a deleted earlier turn names the missing one, not a partial history.
    with pytest.raises(openai.BadRequestError) as broken:
        create(client, input="More", previous_response_id=later.id)
    assert first.id in broken.value.message


def test_store_false_is_not_stored(servers: Servers) -> None:
    response = create(servers.client, input="Say hello", store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        servers.client.responses.retrieve(response.id)


def test_input_items_are_paged(servers: Servers) -> None:
    client = servers.client
    turns = [{"role": "user", "content": f"message {i}"} for i in range(5)]
    response = create(client, input=turns)
    page = client.responses.input_items.list(response.id, limit=2, order="asc")
    assert page.has_more is True and len(page.data) == 2
    assert page.first_id == page.data[0].id and page.last_id == page.data[1].id
    every = list(client.responses.input_items.list(response.id, limit=2, order="asc"))
    assert [item.content[0].text for item in every] == [f"message {i}" for i in range(5)]
    for item in every:
        ITEM.validate_python(item.model_dump())
    newest_first = client.responses.input_items.list(response.id)
    assert [item.id for item in newest_first.data] == [item.id for item in reversed(every)]


def test_streamed_response_is_stored_and_replayed(servers: Servers) -> None:
    client = servers.client
    with client.responses.stream(
        model=MODEL,
        input="Weather in Paris?",
        tools=[{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        extra_body={"mock_response": QWEN3.tool_call},
    ) as stream:
        live = stream.get_final_response()
    replayed = list(client.responses.retrieve(live.id, stream=True))
    for event in replayed:
        EVENT.validate_python(event.model_dump())
    assert replayed[0].type == "response.created" and replayed[-1].type == "response.completed"
    assert [e.sequence_number for e in replayed] == list(range(len(replayed)))
    assert replayed[-1].response.model_dump() == client.responses.retrieve(live.id).model_dump()
    tail = list(client.responses.retrieve(live.id, stream=True, starting_after=3))
    assert [e.sequence_number for e in tail] == list(range(4, len(replayed)))


def test_two_workers_store_concurrently(servers: Servers) -> None:
    client = servers.client

    def conversation(n: int) -> tuple[str, str]:
        first = create(client, input=f"I am user {n}.")
        second = create(client, input="Who am I?", previous_response_id=first.id)
        return first.id, second.id

    with ThreadPoolExecutor(max_workers=8) as pool:
        pairs = list(pool.map(conversation, range(16)))
    for first_id, second_id in pairs:
        assert client.responses.retrieve(second_id).previous_response_id == first_id
        history = client.responses.input_items.list(first_id).data
        assert history[0].content[0].text.startswith("I am user")


def test_a_corrupt_store_stops_the_start(tmp_path: Path) -> None:
    corrupt = tmp_path / "responses.sqlite3"
    corrupt.write_bytes(b"this is not a database" * 100)
    config = store_config(tmp_path, workers=1)
    result = subprocess.run(
        [*pipeserve_command(), "serve", "--config", str(config), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 1
    assert f"the response store {corrupt} cannot be used" in result.stderr
    assert "not a database" in result.stderr


def test_an_unwritable_store_stops_the_start(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    config = store_config(tmp_path, workers=1, store=f"{{path: {blocker / 'responses.sqlite3'}}}")
    result = subprocess.run(
        [*pipeserve_command(), "serve", "--config", str(config), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 1 and "cannot be used" in result.stderr


def test_reasoning_summary_auto_is_non_empty_and_referencable(servers: Servers) -> None:
    client = servers.client
    ask = {"role": "user", "content": "Weather in Paris?"}
    first = create(
        client,
        QWEN3.tool_call,
        input=[ask],
        tools=TOOLS,
        reasoning={"effort": "low", "summary": "auto"},
        include=["reasoning.encrypted_content"],
    )
    reasoning, call = first.output
    assert reasoning.type == "reasoning" and call.type == "function_call"
    assert [part.text for part in reasoning.summary] == ["I need the weather."]
    # Referenced, the summary-only item brings its reasoning into the prompt (Qwen3 keeps
    # the reasoning of a tool-calling turn after the last user message).
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    refs = [{"type": "item_reference", "id": item.id} for item in first.output]
    by_reference = create(client, QWEN3.after_tool, input=[ask, *refs, result], tools=TOOLS)
    in_full = create(client, input=[ask, *dump(first.output), result], tools=TOOLS, store=False)
    no_reasoning = create(client, input=[ask, *dump([call]), result], tools=TOOLS, store=False)
    assert by_reference.usage.input_tokens == in_full.usage.input_tokens
    assert by_reference.usage.input_tokens > no_reasoning.usage.input_tokens
    # Encrypted reasoning keeps working beside the store: the sealed blob alone carries it.
    sealed = {
        "type": "reasoning",
        "id": reasoning.id,
        "summary": [],
        "encrypted_content": reasoning.encrypted_content,
    }
    by_blob = create(client, input=[ask, sealed, *dump([call]), result], tools=TOOLS, store=False)
    assert by_blob.usage.input_tokens == in_full.usage.input_tokens


def test_a_locked_database_delays_no_answer_past_the_lock_timeout(servers: Servers) -> None:
    """Another process holds the write lock: the answer still comes (after the bounded
    wait), marked unstored, and the store works again once the lock is free."""
    holder = sqlite3.connect(servers.folder / "responses.sqlite3", isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        blocked = create(servers.client, input="Say hello")
        holder.execute("ROLLBACK")
    finally:
        holder.close()
    assert blocked.output_text == "Hello there!" and blocked.store is False
    with pytest.raises(openai.NotFoundError):
        servers.client.responses.retrieve(blocked.id)
    after = create(servers.client, input="Say hello")
    assert servers.client.responses.retrieve(after.id).store is True
