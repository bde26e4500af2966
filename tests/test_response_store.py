"""The response store on its own, one behavioural suite run against both backends:
SQLite in a temporary file and a real PostgreSQL (a throwaway cluster, tests/postgres_cluster.py).
Then what only one backend has: SQLite's bad files, PostgreSQL going down and back.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from pipeserve.config.models import ServerSection
from pipeserve.store import (
    MissingResponse,
    ResponseStore,
    SqliteStore,
    StoreBusy,
    StoreError,
    StoreUnavailable,
    sqlite_store,
    worker_response_store,
)
from pipeserve.store.base import Owner
from tests.postgres_cluster import Cluster


@dataclass
class Backend:
    """One database for one test, and the raw SQL access the checks need."""

    name: str
    new_store: Callable[..., ResponseStore]  # bounds as keywords, opened
    execute: Callable[[str], list[tuple[Any, ...]]]  # raw SQL on its own connection
    hold_write_lock: Callable[[], AbstractContextManager[None]]
    set_version: Callable[[int], None]
    responses: str  # the responses table's name
    module: Any  # the backend's module (SCHEMA_VERSION, MIGRATIONS)
    version: Callable[[], int]  # the recorded schema version


def bounds(given: dict[str, Any]) -> tuple[float, int, float]:
    return (
        given.get("max_age_days", 30.0),
        given.get("max_bytes", 1 << 20),
        given.get("lock_timeout", 0.5),
    )


def sqlite_backend(path: Path) -> Backend:
    def new_store(**given: Any) -> ResponseStore:
        store = SqliteStore(path, *bounds(given))
        store.open_checked()
        return store

    def execute(query: str) -> list[tuple[Any, ...]]:
        with sqlite3.connect(path) as conn:
            return conn.execute(query).fetchall()

    @contextmanager
    def hold_write_lock() -> Iterator[None]:
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            holder.execute("ROLLBACK")
            holder.close()

    def set_version(version: int) -> None:
        execute(f"PRAGMA user_version = {version}")

    def version() -> int:
        return int(execute("PRAGMA user_version")[0][0])

    return Backend(
        "sqlite",
        new_store,
        execute,
        hold_write_lock,
        set_version,
        "responses",
        sqlite_store,
        version,
    )


def postgres_backend(cluster: Cluster) -> Backend:
    import psycopg

    from pipeserve.store import postgres_store
    from pipeserve.store.postgres_store import PostgresStore

    cluster.wipe()

    def new_store(**given: Any) -> ResponseStore:
        store = PostgresStore(cluster.url_with_password, *bounds(given))
        store.open_checked()
        return store

    def execute(query: str) -> list[tuple[Any, ...]]:
        with psycopg.connect(cluster.url_with_password, autocommit=True) as conn:
            cursor = conn.execute(query)
            return cursor.fetchall() if cursor.description else []

    @contextmanager
    def hold_write_lock() -> Iterator[None]:
        with psycopg.connect(cluster.url_with_password) as holder:
            holder.execute("LOCK TABLE pipeserve_usage IN EXCLUSIVE MODE")  # writers wait
            yield
            holder.rollback()

    def set_version(version: int) -> None:
        execute(f"INSERT INTO pipeserve_schema (version) VALUES ({version})")

    def version() -> int:
        return int(execute("SELECT max(version) FROM pipeserve_schema")[0][0])

    return Backend(
        "postgres",
        new_store,
        execute,
        hold_write_lock,
        set_version,
        "pipeserve_responses",
        postgres_store,
        version,
    )


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "sqlite":
        return sqlite_backend(tmp_path / "r.sqlite3")
    return postgres_backend(request.getfixturevalue("postgres"))


def response(rid: str, *texts: str) -> dict[str, Any]:
    output = [{"id": f"msg_{rid}_{i}", "type": "message", "text": t} for i, t in enumerate(texts)]
    return {"id": rid, "status": "completed", "output": output}


# ---------------------------------------------------------------- the shared suite


def test_round_trip_and_chain(backend: Backend) -> None:
    store = backend.new_store()
    store.save(response("resp_a", "A"), [{"id": "msg_in_a", "type": "message"}], None)
    store.save(response("resp_b", "B"), [{"id": "msg_in_b", "type": "message"}], "resp_a")
    assert store.get("resp_b") == response("resp_b", "B")
    history = [item["id"] for item in store.history("resp_b")]
    assert history == ["msg_in_a", "msg_resp_a_0", "msg_in_b", "msg_resp_b_0"]
    assert store.items(["msg_resp_a_0", "unknown"]) == {
        "msg_resp_a_0": response("resp_a", "A")["output"][0]
    }
    assert store.delete("resp_a") and not store.delete("resp_a")
    with pytest.raises(MissingResponse) as missing:
        store.history("resp_b")
    assert missing.value.response_id == "resp_a"  # the gap, not the id asked for


def test_input_items_pages(backend: Backend) -> None:
    store = backend.new_store()
    items = [{"id": f"msg_{i}", "type": "message"} for i in range(5)]
    store.save(response("resp_p"), items, None)
    first = store.input_items("resp_p", None, 2, "asc")
    assert first is not None and [i["id"] for i in first.items] == ["msg_0", "msg_1"]
    assert first.has_more
    last = store.input_items("resp_p", "msg_3", 2, "asc")
    assert last is not None and [i["id"] for i in last.items] == ["msg_4"] and not last.has_more
    newest = store.input_items("resp_p", None, 20, "desc")
    assert newest is not None and newest.items[0]["id"] == "msg_4"
    assert store.input_items("resp_none", None, 2, "asc") is None


def test_size_bound_expires_the_oldest_first(backend: Backend) -> None:
    store = backend.new_store(max_bytes=1 << 20)
    for i in range(120):
        store.save(response(f"resp_{i:03d}", "x" * 20_000), [], None)
    kept = [row[0] for row in backend.execute(f"SELECT id FROM {backend.responses}")]
    assert 10 < len(kept) < 120
    assert sorted(kept) == [f"resp_{i:03d}" for i in range(120 - len(kept), 120)]
    assert store.get("resp_119") is not None and store.get("resp_000") is None


def test_age_bound_expires(backend: Backend) -> None:
    store = backend.new_store(max_age_days=1.0)
    store.save(response("resp_old", "x"), [], None)
    backend.execute(f"UPDATE {backend.responses} SET stored_at = {time.time() - 2 * 86400}")
    assert store.get("resp_old") is None  # expired on read, before any pruning write
    assert store.items(["msg_resp_old_0"]) == {}
    assert store.input_items("resp_old", None, 2, "asc") is None
    assert not store.delete("resp_old")
    with pytest.raises(MissingResponse):
        store.history("resp_old")
    store.save(response("resp_new", "y"), [], None)  # a write deletes what expired
    assert [row[0] for row in backend.execute(f"SELECT id FROM {backend.responses}")] == [
        "resp_new"
    ]


def test_survives_reopening(backend: Backend) -> None:
    backend.new_store().save(response("resp_k", "kept"), [], None)
    assert backend.new_store().get("resp_k") == response("resp_k", "kept")


def test_a_held_lock_is_a_bounded_wait(backend: Backend) -> None:
    """Another writer holds the lock: a save waits at most lock_timeout (StoreBusy),
    reads are not blocked, and writing works again once the lock is free."""
    store = backend.new_store(lock_timeout=0.2)
    store.save(response("resp_before", "x"), [], None)
    with backend.hold_write_lock():
        with pytest.raises(StoreBusy):
            store.save(response("resp_l", "x"), [], None)
        assert store.get("resp_l") is None and store.get("resp_before") is not None
    store.save(response("resp_l", "x"), [], None)
    assert store.get("resp_l") is not None


def test_the_schema_version_is_recorded_and_a_newer_one_refused(backend: Backend) -> None:
    backend.new_store().save(response("resp_v", "x"), [], None)
    backend.new_store()  # the current version: opened as it is
    backend.set_version(99)
    known = backend.module.SCHEMA_VERSION
    with pytest.raises(StoreError, match=f"schema version 99, newer than the {known} this"):
        backend.new_store()


def test_a_later_version_migrates_the_database_in_place(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A (test-only) next migration runs once on a current database; its data stays."""
    backend.new_store().save(response("resp_m", "kept"), [], None)
    table = "migrated_extra" if backend.name == "sqlite" else "pipeserve_migrated_extra"
    following = backend.module.SCHEMA_VERSION + 1
    steps = {**backend.module.MIGRATIONS, following: f"CREATE TABLE {table} (x integer)"}
    monkeypatch.setattr(backend.module, "MIGRATIONS", steps)
    monkeypatch.setattr(backend.module, "SCHEMA_VERSION", following)
    store = backend.new_store()
    assert backend.version() == following
    assert backend.execute(f"SELECT count(*) FROM {table}") == [(0,)]
    assert store.get("resp_m") == response("resp_m", "kept")
    backend.new_store()  # the new version now: nothing to apply again


def test_servers_starting_together_on_an_empty_database_do_not_race(backend: Backend) -> None:
    """Eight stores (as eight servers would) create the schema at the same moment."""
    start = threading.Barrier(8)

    def open_one(n: int) -> str:
        start.wait()
        store = backend.new_store()
        store.save(response(f"resp_{n}", "x"), [], None)
        return f"resp_{n}"

    with ThreadPoolExecutor(max_workers=8) as pool:
        ids = list(pool.map(open_one, range(8)))
    store = backend.new_store()
    assert all(store.get(rid) is not None for rid in ids)
    if backend.name == "postgres":
        versions = backend.execute("SELECT version FROM pipeserve_schema ORDER BY version")
        assert versions == [(v,) for v in range(1, backend.module.SCHEMA_VERSION + 1)]


def test_stores_sharing_a_database_lose_nothing(backend: Backend) -> None:
    """Two store objects (two servers) write 32 two-turn conversations concurrently;
    every response is then readable, with its chain, through either."""
    stores = [backend.new_store(max_bytes=64 << 20), backend.new_store(max_bytes=64 << 20)]

    def conversation(n: int) -> str:
        here, there = stores[n % 2], stores[(n + 1) % 2]
        here.save(response(f"resp_{n}_a", f"a{n}"), [{"id": f"in_{n}_a"}], None)
        there.save(response(f"resp_{n}_b", f"b{n}"), [{"id": f"in_{n}_b"}], f"resp_{n}_a")
        return f"resp_{n}_b"

    with ThreadPoolExecutor(max_workers=16) as pool:
        last_turns = list(pool.map(conversation, range(32)))
    for n, rid in enumerate(last_turns):
        for store in stores:
            history = [item["id"] for item in store.history(rid)]
            assert history == [f"in_{n}_a", f"msg_resp_{n}_a_0", f"in_{n}_b", f"msg_resp_{n}_b_0"]


def test_a_response_is_seen_whole_or_not_at_all(backend: Backend) -> None:
    """A reader polling while responses with many items are written never sees one
    without all its output."""
    writer, reader = backend.new_store(max_bytes=64 << 20), backend.new_store()
    texts = [f"part {i}" for i in range(30)]
    done = threading.Event()
    seen: list[int] = []

    def read() -> None:
        while not done.is_set():
            for n in range(20):
                found = reader.get(f"resp_{n}")
                if found is not None:
                    seen.append(len(found["output"]))

    thread = threading.Thread(target=read)
    thread.start()
    try:
        for n in range(20):
            writer.save(response(f"resp_{n}", *texts), [{"id": f"in_{n}"}], None)
    finally:
        done.set()
        thread.join()
    assert set(seen) <= {30}


# ---------------------------------------------------------------- SQLite only


def test_corrupt_and_unwritable_files_are_store_errors(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.sqlite3"
    corrupt.write_bytes(b"garbage" * 1000)
    with pytest.raises(StoreError, match="not a database"):
        sqlite_backend(corrupt).new_store()
    (tmp_path / "file").write_text("")
    with pytest.raises(StoreError):
        sqlite_backend(tmp_path / "file" / "r.sqlite3").new_store()


def test_workers_share_one_store_per_setting(tmp_path: Path) -> None:
    server = ServerSection(responses_store={"path": str(tmp_path / "r.sqlite3")})
    first = worker_response_store(server, tmp_path)
    assert first is not None and worker_response_store(server, tmp_path) is first
    assert worker_response_store(ServerSection(responses_store=False), tmp_path) is None
    bad = ServerSection(responses_store={"path": str(tmp_path / "r.sqlite3" / "x.sqlite3")})
    with pytest.raises(StoreError):
        worker_response_store(bad, tmp_path)


# ---------------------------------------------------------------- PostgreSQL only


def test_postgres_down_is_unavailable_and_the_store_reconnects(
    postgres: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """The database stops: calls fail within their bounds (StoreUnavailable, a 503 to
    clients that does not say where the database is; the log says it once per outage);
    once it is back the same store works again without being reopened."""
    from pipeserve.api.openai_responses.state import store_fault

    store = postgres_backend(postgres).new_store(lock_timeout=0.5)
    store.save(response("resp_up", "x"), [], None)
    caplog.set_level("WARNING", logger="pipeserve.store")
    postgres.stop()
    try:
        with pytest.raises(StoreUnavailable):
            store.get("resp_up")
        with pytest.raises(StoreUnavailable) as down:
            store.save(response("resp_down", "x"), [], None)
        assert "last attempt: connection to server at" in str(down.value)  # libpq's reason
    finally:
        postgres.start()
    fault = store_fault(down.value)
    assert fault.default_status == 503 and fault.retry_after == 1
    assert fault.message == "the response store is unavailable; retry later"
    logged = [r.getMessage() for r in caplog.records if r.name == "pipeserve.store"]
    assert len(logged) == 1 and f"127.0.0.1:{postgres.port}" in logged[0], logged
    deadline = time.monotonic() + 60
    while True:
        try:
            store.save(response("resp_back", "x"), [], None)
            break
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    assert store.get("resp_up") is not None and store.get("resp_back") is not None
    assert store.get("resp_down") is None
    back = [r.getMessage() for r in caplog.records if "can be reached again" in r.getMessage()]
    assert len(back) == 1, caplog.records


def test_postgres_size_counter_follows_every_change(postgres: Cluster) -> None:
    """The total the size bound reads is kept by triggers: right after saves, replaces,
    deletes, pruning, and an operator's own DELETE and TRUNCATE."""
    backend = postgres_backend(postgres)
    store = backend.new_store(max_bytes=1 << 20)

    def counted() -> tuple[int, int]:
        total = backend.execute("SELECT bytes FROM pipeserve_usage")[0][0]
        rows = backend.execute("SELECT coalesce(sum(size), 0) FROM pipeserve_responses")[0][0]
        return int(total), int(rows)

    for i in range(80):
        store.save(response(f"resp_{i}", "x" * 20_000), [{"id": f"in_{i}"}], None)
    store.save(response("resp_79", "replaced"), [], None)
    store.delete("resp_78")
    total, rows = counted()
    assert total == rows and 0 < total <= 1 << 20
    backend.execute("DELETE FROM pipeserve_responses WHERE id = 'resp_77'")
    assert counted()[0] == counted()[1]
    backend.execute("TRUNCATE pipeserve_responses CASCADE")
    assert counted() == (0, 0)


def test_postgres_unreachable_at_start_is_unavailable_not_unusable(postgres: Cluster) -> None:
    from pipeserve.store.postgres_store import PostgresStore

    url = f"postgresql://nobody@127.0.0.1:{postgres.port + 1}/postgres"  # nothing listens
    with pytest.raises(StoreUnavailable, match="PostgreSQL postgresql://nobody@127.0.0.1"):
        PostgresStore(url, 30, 1 << 20, 0.5).open_checked()


def test_the_store_setting_is_validated() -> None:
    from pipeserve.store.postgres_store import display_url

    ok = ServerSection(responses_store={"url": "postgresql://app@db:5432/pipeserve"})
    assert ok.responses_store is not False and ok.responses_store.url is not None
    for bad in (
        {"url": "mysql://db/x"},
        {"url": "postgresql://db:notaport/x"},
        {"url": "postgresql://db/x", "path": "r.sqlite3"},
    ):
        with pytest.raises(ValidationError):
            ServerSection(responses_store=bad)
    shown = display_url("postgresql://app:s3cret@db:5433/store?sslmode=require")
    assert shown == "PostgreSQL postgresql://app@db:5433/store" and "s3cret" not in shown


GEVENT_PROBE = """
from gevent import monkey; monkey.patch_all()
import sys, gevent
from tests.test_response_store import probe_backend

store, hold_write_lock = probe_backend(sys.argv[1], sys.argv[2])
state = {"done": False, "ticks_while_waiting": 0}

def save():
    try:
        store.save({"id": "resp_x", "status": "completed", "output": []}, [], None)
    except Exception as exc:
        state["error"] = type(exc).__name__
    state["done"] = True

def tick():
    while not state["done"]:
        state["ticks_while_waiting"] += 1
        gevent.sleep(0.01)

with hold_write_lock():
    gevent.joinall([gevent.spawn(save), gevent.spawn(tick)])
print(state.get("error"), state["ticks_while_waiting"])
"""


def probe_backend(kind: str, where: str) -> tuple[ResponseStore, Callable[[], Any]]:
    """For the probe: a store waiting 1 s for a lock another connection holds."""
    if kind == "sqlite":
        backend = sqlite_backend(Path(where))
    else:
        port = int(where)
        backend = postgres_backend(Cluster(Path(), Path(), port, None))
    return backend.new_store(lock_timeout=1.0), backend.hold_write_lock


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_a_lock_wait_under_gevent_leaves_the_hub_running(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Under gevent a store call waiting for a lock blocks only its greenlet: another
    greenlet keeps running meanwhile (SQLite: on its own threads; psycopg: waits
    cooperatively when imported after the patching, as in a worker)."""
    where = str(tmp_path / "r.sqlite3")
    if kind == "postgres":
        where = str(request.getfixturevalue("postgres").port)
    probe = subprocess.run(
        [sys.executable, "-c", GEVENT_PROBE, kind, where],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    error, ticks = probe.stdout.split()
    assert error == "StoreBusy" and int(ticks) > 1


# ---------------------------------------------------------------- owners (issue 34)

ALICE = Owner("k:alice")
BOB = Owner("k:bob")


def test_a_response_is_seen_only_by_the_key_that_stored_it(backend: Backend) -> None:
    """Another key gets nothing: no body, no input items, no continuation, no item, no
    delete; the owner still sees all of it afterwards."""
    store = backend.new_store()
    store.save(response("resp_a", "secret"), [{"id": "msg_in_a", "type": "message"}], None,
               ALICE, "secret-model")  # fmt: skip
    assert store.get("resp_a", BOB) is None and store.get("resp_a") is None
    assert store.input_items("resp_a", None, 5, "asc", BOB) is None
    with pytest.raises(MissingResponse):
        store.history("resp_a", BOB)
    assert store.items(["msg_resp_a_0", "msg_in_a"], BOB) == {}
    assert not store.delete("resp_a", BOB)
    assert store.get("resp_a", ALICE) == response("resp_a", "secret")
    assert [i["id"] for i in store.history("resp_a", ALICE)] == ["msg_in_a", "msg_resp_a_0"]
    assert set(store.items(["msg_resp_a_0", "msg_in_a"], ALICE)) == {"msg_resp_a_0", "msg_in_a"}
    assert store.delete("resp_a", ALICE)


def test_a_key_sees_only_responses_of_models_in_its_scope(backend: Backend) -> None:
    store = backend.new_store()
    store.save(response("resp_s", "x"), [{"id": "msg_in_s"}], None, ALICE, "secret")
    public_only = Owner(ALICE.key, frozenset({"public"}))
    assert store.get("resp_s", public_only) is None
    assert store.input_items("resp_s", None, 5, "asc", public_only) is None
    assert store.items(["msg_resp_s_0"], public_only) == {}
    with pytest.raises(MissingResponse):
        store.history("resp_s", public_only)
    assert not store.delete("resp_s", Owner(ALICE.key, frozenset()))
    assert store.get("resp_s", Owner(ALICE.key, frozenset({"public", "secret"}))) is not None


def test_an_input_item_cannot_take_over_another_keys_item_id(backend: Backend) -> None:
    """Bob stores an input item with the id of Alice's output item: Alice's reference
    still resolves to her own item, and so does Bob's own (an output item's id is the
    server's, and wins over an input item sent with the same id)."""
    store = backend.new_store()
    store.save(response("resp_a", "mine"), [], None, ALICE, "m")
    forged = {"id": "msg_resp_a_0", "type": "message", "text": "forged"}
    store.save(response("resp_b", "x"), [forged], None, BOB, "m")
    assert store.items(["msg_resp_a_0"], ALICE)["msg_resp_a_0"]["text"] == "mine"
    assert store.items(["msg_resp_a_0"], BOB)["msg_resp_a_0"]["text"] == "forged"
    store.save(response("resp_c", "x"), [forged], None, ALICE, "m")  # her own, later
    assert store.items(["msg_resp_a_0"], ALICE)["msg_resp_a_0"]["text"] == "mine"


def test_a_chain_through_another_keys_response_is_broken_there(backend: Backend) -> None:
    store = backend.new_store()
    store.save(response("resp_1", "a"), [], None, BOB, "m")
    store.save(response("resp_2", "b"), [], "resp_1", ALICE, "m")  # (only a bug could)
    with pytest.raises(MissingResponse) as missing:
        store.history("resp_2", ALICE)
    assert missing.value.response_id == "resp_1"


def test_version_1_rows_migrate_to_the_keyless_owner_with_their_model(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A database written by the previous pipeserve (schema 1) migrates in place: its
    responses keep answering a server without keys, no key sees them, and their model
    column comes from the stored body."""
    with monkeypatch.context() as old:
        old.setattr(backend.module, "SCHEMA_VERSION", 1)
        old.setattr(backend.module, "MIGRATIONS", {1: backend.module.MIGRATIONS[1]})
        store = backend.new_store()
        body = {**response("resp_old", "kept"), "model": "public"}
        table = backend.responses
        store._call(lambda conn: _insert_v1(backend, conn, table, body))
    migrated = backend.new_store()
    assert backend.version() == backend.module.SCHEMA_VERSION
    assert migrated.get("resp_old") == body
    assert migrated.get("resp_old", ALICE) is None
    assert migrated.get("resp_old", Owner("", frozenset({"public"}))) == body
    assert migrated.get("resp_old", Owner("", frozenset({"other"}))) is None


def _insert_v1(backend: Backend, conn: Any, table: str, body: dict[str, Any]) -> None:
    """A row as schema 1 wrote it (its own column list), with its one output item."""
    import json

    head = json.dumps({k: v for k, v in body.items() if k != "output"})
    item = json.dumps(body["output"][0])
    mark = "?" if backend.name == "sqlite" else "%s"
    items = "items" if backend.name == "sqlite" else "pipeserve_items"
    columns = "(id, stored_at, previous_id, body)"
    values = [body["id"], time.time(), None, head]
    if backend.name == "postgres":
        columns, values = "(id, stored_at, previous_id, size, body)", [*values[:3], 10, head]
    conn.execute(f"INSERT INTO {table} {columns} VALUES ({', '.join([mark] * len(values))})",
                 values)  # fmt: skip
    conn.execute(f"INSERT INTO {items} VALUES ({', '.join([mark] * 5)})",
                 (body["id"], "output", 0, body["output"][0]["id"], item))  # fmt: skip
