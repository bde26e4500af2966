"""The SQLite response store on its own: bounds, expiry, chains, bad files, sharing."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pipeserve.config.models import ServerSection
from pipeserve.store import (
    MissingResponse,
    ResponseStore,
    StoreBusy,
    StoreError,
    worker_response_store,
)


def make(path: Path, **bounds: Any) -> ResponseStore:
    store = ResponseStore(
        path,
        bounds.get("max_age_days", 30.0),
        bounds.get("max_bytes", 1 << 20),
        bounds.get("lock_timeout", 0.2),
    )
    store.open_checked()
    return store


def response(rid: str, *texts: str) -> dict[str, Any]:
    output = [{"id": f"msg_{rid}_{i}", "type": "message", "text": t} for i, t in enumerate(texts)]
    return {"id": rid, "status": "completed", "output": output}


def test_round_trip_and_chain(tmp_path: Path) -> None:
    store = make(tmp_path / "r.sqlite3")
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


def test_input_items_pages(tmp_path: Path) -> None:
    store = make(tmp_path / "r.sqlite3")
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


def test_size_bound_expires_the_oldest_first(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    store = make(path, max_bytes=1 << 20)
    for i in range(120):
        store.save(response(f"resp_{i:03d}", "x" * 20_000), [], None)
    kept = [row[0] for row in sqlite3.connect(path).execute("SELECT id FROM responses")]
    assert 10 < len(kept) < 120
    assert sorted(kept) == [f"resp_{i:03d}" for i in range(120 - len(kept), 120)]
    assert store.get("resp_119") is not None and store.get("resp_000") is None


def test_age_bound_expires(tmp_path: Path) -> None:
    store = make(tmp_path / "r.sqlite3", max_age_days=1.0)
    store.save(response("resp_old", "x"), [], None)
    with sqlite3.connect(tmp_path / "r.sqlite3") as conn:
        conn.execute("UPDATE responses SET stored_at = ?", (time.time() - 2 * 86400,))
    assert store.get("resp_old") is None  # expired on read, before any pruning write
    assert store.items(["msg_resp_old_0"]) == {}
    with pytest.raises(MissingResponse):
        store.history("resp_old")


def test_survives_reopening(tmp_path: Path) -> None:
    make(tmp_path / "r.sqlite3").save(response("resp_k", "kept"), [], None)
    assert make(tmp_path / "r.sqlite3").get("resp_k") == response("resp_k", "kept")


def test_corrupt_and_unwritable_files_are_store_errors(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.sqlite3"
    corrupt.write_bytes(b"garbage" * 1000)
    with pytest.raises(StoreError, match="not a database"):
        make(corrupt)
    (tmp_path / "file").write_text("")
    with pytest.raises(StoreError):
        make(tmp_path / "file" / "r.sqlite3")


def test_a_held_lock_is_a_bounded_wait(tmp_path: Path) -> None:
    store = make(tmp_path / "r.sqlite3", lock_timeout=0.2)
    holder = sqlite3.connect(tmp_path / "r.sqlite3", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(StoreBusy):
            store.save(response("resp_l", "x"), [], None)
        assert store.get("resp_l") is None  # readers are not blocked (WAL)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    store.save(response("resp_l", "x"), [], None)
    assert store.get("resp_l") is not None


def test_workers_share_one_store_per_setting(tmp_path: Path) -> None:
    server = ServerSection(responses_store={"path": str(tmp_path / "r.sqlite3")})
    first = worker_response_store(server, tmp_path)
    assert first is not None and worker_response_store(server, tmp_path) is first
    assert worker_response_store(ServerSection(responses_store=False), tmp_path) is None
    bad = ServerSection(responses_store={"path": str(tmp_path / "r.sqlite3" / "x.sqlite3")})
    with pytest.raises(StoreError):
        worker_response_store(bad, tmp_path)


GEVENT_PROBE = """
from gevent import monkey; monkey.patch_all()
import sqlite3, sys, gevent
from pathlib import Path
from pipeserve.store import ResponseStore, StoreBusy

path = Path(sys.argv[1])
store = ResponseStore(path, 30, 1 << 20, 1.0)
store.open_checked()
holder = sqlite3.connect(path, isolation_level=None)
holder.execute("BEGIN IMMEDIATE")
state = {"done": False, "ticks_while_waiting": 0}

def save():
    try:
        store.save({"id": "resp_x", "status": "completed", "output": []}, [], None)
    except StoreBusy:
        pass
    state["done"] = True

def tick():
    while not state["done"]:
        state["ticks_while_waiting"] += 1
        gevent.sleep(0.01)

gevent.joinall([gevent.spawn(save), gevent.spawn(tick)])
print(state["ticks_while_waiting"])
"""


def test_a_lock_wait_under_gevent_leaves_the_hub_running(tmp_path: Path) -> None:
    """Under gevent a store call waiting for the lock blocks only its greenlet: another
    greenlet keeps running meanwhile (on the hub, sqlite's busy wait would stop it)."""
    probe = subprocess.run(
        [sys.executable, "-c", GEVENT_PROBE, str(tmp_path / "r.sqlite3")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert int(probe.stdout.strip()) > 1
