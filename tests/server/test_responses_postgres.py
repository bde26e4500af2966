"""Two real pipeserve servers sharing one PostgreSQL response store (replay engine).

The cluster is a throwaway one (tests/postgres_cluster.py, skipped with one line where
it cannot start); the servers reach it on 127.0.0.1 with a URL without password, which
comes from PGPASSWORD as libpq reads it. A conversation moves between the servers with
the openai SDK and with the Vercel AI SDK's multi-turn flow, 32 conversations run at
once over both, and the database stops and comes back while the servers keep running.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types.responses import Response

from tests.postgres_cluster import PASSWORD, Cluster
from tests.server.scenarios import QWEN3
from tests.server.serverproc import pipeserve_command, running_server, server_log
from tests.server.store_servers import store_config
from tests.server.test_vercel_ai_sdk import run_the_sdk, serve_recorded_requests

pytestmark = pytest.mark.server

MODEL = QWEN3.model


@dataclass
class Shared:
    cluster: Cluster
    bases: list[str]
    clients: list[OpenAI]
    folder: Path


def server_config(folder: Path, cluster: Cluster) -> Path:
    """One replay model on /v1/responses, its store the cluster (lock_timeout short)."""
    folder.mkdir(exist_ok=True)
    return store_config(folder, workers=1, store=f"{{url: '{cluster.url}', lock_timeout: 1.0}}")


@pytest.fixture(scope="module")
def shared(postgres: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    postgres.wipe()  # the servers create the schema
    folder = tmp_path_factory.mktemp("pg-servers")
    env = {"PGPASSWORD": PASSWORD}
    configs = [server_config(folder / name, postgres) for name in ("a", "b")]
    with ExitStack() as stack, ThreadPoolExecutor(max_workers=2) as starting:
        # Started together: both create the schema on the empty database at once.
        bases = list(
            starting.map(lambda config: stack.enter_context(running_server(config, env)), configs)
        )
        clients = [OpenAI(base_url=f"{b}/v1", api_key="x", max_retries=0) for b in bases]
        yield Shared(postgres, bases, clients, folder)


def create(client: OpenAI, **fields: Any) -> Response:
    return client.responses.create(model=MODEL, extra_body={"mock_response": QWEN3.reasoning}, **fields)  # fmt: skip


def dump(items: list[Any]) -> list[dict[str, Any]]:
    return [item.model_dump(exclude_none=True) for item in items]


def test_a_conversation_moves_between_servers(shared: Shared) -> None:
    a, b = shared.clients
    first = create(a, input="My name is Ada.")
    assert first.store is True
    # Continued on the other server: the prompt holds the first turn, token for token.
    second = create(b, input="What is my name?", previous_response_id=first.id)
    history = [{"role": "user", "content": "My name is Ada."}, *dump(first.output)]
    history.append({"role": "user", "content": "What is my name?"})
    assert second.usage.input_tokens == create(a, input=history, store=False).usage.input_tokens
    # Referenced by item, fetched and listed on the other server.
    turn = {"role": "user", "content": "Again?"}
    refs = [{"type": "item_reference", "id": item.id} for item in first.output]
    by_reference = create(b, input=[history[0], *refs, turn])
    in_full = create(a, input=[history[0], *dump(first.output), turn], store=False)
    assert by_reference.usage.input_tokens == in_full.usage.input_tokens
    assert b.responses.retrieve(first.id).model_dump() == first.model_dump()
    listed = a.responses.input_items.list(by_reference.id, order="asc")
    assert [item.id for item in listed.data][1:3] == [item.id for item in first.output]
    # Deleted on one, gone on both.
    assert b.responses.delete(first.id) is None
    for client in (a, b):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as broken:
        create(a, input="More", previous_response_id=second.id)
    assert first.id in broken.value.message


def test_vercel_ai_sdk_turns_alternate_between_servers(shared: Shared) -> None:
    """Each turn of the SDK's flow (the recorded requests, then the SDK itself where
    node is installed) goes to the other server; item_references resolve there."""
    serve_recorded_requests(shared.bases)
    run_the_sdk(shared.bases)


def test_32_concurrent_conversations_lose_nothing(shared: Shared) -> None:
    a, b = shared.clients

    def conversation(n: int) -> list[str]:
        here, there = (a, b) if n % 2 else (b, a)
        first = create(here, input=f"I am user {n}.")
        second = create(there, input="Who am I?", previous_response_id=first.id)
        third = create(here, input="Once more?", previous_response_id=second.id)
        return [first.id, second.id, third.id]

    with ThreadPoolExecutor(max_workers=16) as pool:
        chains = list(pool.map(conversation, range(32)))
    for n, (first, second, third) in enumerate(chains):
        for client in (a, b):
            assert client.responses.retrieve(third).previous_response_id == second
            assert client.responses.retrieve(second).previous_response_id == first
            said = client.responses.input_items.list(first).data[0].content[0].text
            assert said == f"I am user {n}."


def test_a_newer_schema_stops_the_start(shared: Shared, tmp_path: Path) -> None:
    """A database a newer pipeserve wrote (schema version 99): serve refuses to start,
    naming the store and the versions (checked in a child of the master)."""
    import psycopg

    from pipeserve.store import postgres_store

    cluster = shared.cluster
    with psycopg.connect(cluster.url_with_password, autocommit=True) as conn:
        conn.execute("DROP DATABASE IF EXISTS newer")
        conn.execute("CREATE DATABASE newer")
    newer = cluster.url_with_password.rsplit("/", 1)[0] + "/newer"
    with psycopg.connect(newer, autocommit=True) as conn:
        conn.execute("CREATE TABLE pipeserve_schema (version integer PRIMARY KEY)")
        conn.execute("INSERT INTO pipeserve_schema VALUES (99)")
    url = cluster.url.rsplit("/", 1)[0] + "/newer"
    config = store_config(tmp_path, workers=1, store=f"{{url: '{url}'}}")
    result = subprocess.run(
        [*pipeserve_command(), "serve", "--config", str(config), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PGPASSWORD": PASSWORD},
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert f"the response store PostgreSQL {url} cannot be used" in result.stderr
    known = postgres_store.SCHEMA_VERSION
    assert f"schema version 99, newer than the {known} this pipeserve understands" in result.stderr


def status_of(base: str, method: str, path: str, **body: Any) -> tuple[int, dict[str, Any]]:
    response = httpx.request(method, f"{base}{path}", json=body or None, timeout=60)
    if response.status_code == 503:
        assert response.headers["retry-after"] == "1"
    return response.status_code, response.json()


def test_postgres_stopped_mid_run_then_back(shared: Shared, tmp_path: Path) -> None:
    """Stopped: store requests are a 503 in OpenAI's error shape, the rest is served (an
    answer comes unstored); a server started meanwhile starts and does the same. Back:
    storing resumes on every server, none restarted."""
    a, b = shared.clients
    kept = create(a, input="Before the outage")
    shared.cluster.stop()
    try:
        with running_server(server_config(tmp_path / "c", shared.cluster), {"PGPASSWORD": PASSWORD}) as c_base:  # fmt: skip
            bases = [*shared.bases, c_base]
            for base in bases:
                check_outage(base, kept.id, shared.cluster)
            shared.cluster.start()
            for base in bases:
                wait_until_stored(base)
    finally:
        if not cluster_up(shared.cluster):
            shared.cluster.start()
    assert b.responses.retrieve(kept.id).output_text == kept.output_text
    for base in bases:
        check_outage_logged_once(base, shared.cluster)


def check_outage(base: str, kept_id: str, cluster: Cluster) -> None:
    ask = {"model": MODEL, "mock_response": QWEN3.reasoning}
    for method, path, body in (
        ("GET", f"/v1/responses/{kept_id}", {}),
        ("GET", f"/v1/responses/{kept_id}/input_items", {}),
        ("DELETE", f"/v1/responses/{kept_id}", {}),
        ("POST", "/v1/responses", {**ask, "input": "Hi", "previous_response_id": kept_id}),
        ("POST", "/v1/responses", {**ask, "input": [{"type": "item_reference", "id": "msg_x"}]}),
    ):
        status, answer = status_of(base, method, path, **body)
        assert status == 503, (method, path, answer)
        message = answer["error"]["message"]
        assert answer["error"]["type"] and "response store is unavailable" in message
        # Where the database is (user, host, port, libpq's reason) stays in the log.
        assert str(cluster.port) not in message and "127.0.0.1" not in message, message
    status, answer = status_of(base, "POST", "/v1/responses", **ask, input="Hi")
    assert status == 200 and answer["store"] is False and answer["status"] == "completed"
    status, answer = status_of(base, "POST", "/v1/responses", **ask, input="Hi", store=False)
    assert status == 200 and answer["store"] is False


def check_outage_logged_once(base: str, cluster: Cluster) -> None:
    """The server's log names the database and libpq's reason once for the outage (not per
    request, nor the password), and says once that it is back."""
    log = server_log(base).read_text()
    down = [line for line in log.splitlines() if "the response store cannot be reached (" in line]
    assert len(down) == 1, down
    assert f"@127.0.0.1:{cluster.port}/" in down[0]
    assert PASSWORD not in log and "error connecting" not in log  # nor each pool attempt
    assert log.count("can be reached again") == 1, log[-4000:]


def wait_until_stored(base: str, attempts: int = 120) -> None:
    """Ask until an answer is stored again (the pool reconnects in the background)."""
    ask = {"model": MODEL, "mock_response": QWEN3.reasoning, "input": "Back?"}
    for _ in range(attempts):
        status, answer = status_of(base, "POST", "/v1/responses", **ask)
        assert status == 200, answer
        if answer["store"]:
            status, again = status_of(base, "GET", f"/v1/responses/{answer['id']}")
            assert status == 200 and again["id"] == answer["id"]
            return
        time.sleep(0.5)
    raise AssertionError(f"{base} did not store again after the database came back")


def cluster_up(cluster: Cluster) -> bool:
    import psycopg

    try:
        psycopg.connect(cluster.url_with_password, connect_timeout=2).close()
        return True
    except psycopg.OperationalError:
        return False
