"""The response store: stored OpenAI Responses and their items in one SQLite file.

One file is shared by every gunicorn worker: WAL mode lets readers run beside the one
writer, writers take the lock up front (BEGIN IMMEDIATE) and wait at most
`lock_timeout` seconds for it (then StoreBusy, a 503). Each response row holds the
Response object without its output; its input and output items are rows of `items`,
found by their own ids for item_reference. Writes expire what is older than the age
bound, then the oldest responses until the used pages fit the size bound.

All calls run off the gevent hub (see offhub.py); each takes a pooled connection.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pipeserve.engine.channel import os_lock
from pipeserve.store.offhub import OffHub

log = logging.getLogger("pipeserve.store")

SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    stored_at REAL NOT NULL,
    previous_id TEXT,
    body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (stored_at);
CREATE TABLE IF NOT EXISTS items (
    response_id TEXT NOT NULL REFERENCES responses (id) ON DELETE CASCADE,
    source TEXT NOT NULL CHECK (source IN ('input', 'output')),
    position INTEGER NOT NULL,
    item_id TEXT NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (response_id, source, position)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS items_by_id ON items (item_id);
"""
# The chain of previous_response_id links from one response back to the first (bounded).
CHAIN = """
WITH RECURSIVE chain (id, depth) AS (
    SELECT id, 0 FROM responses WHERE id = ? AND stored_at >= ?
    UNION ALL
    SELECT r.previous_id, c.depth + 1 FROM chain c JOIN responses r ON r.id = c.id
    WHERE r.previous_id IS NOT NULL AND c.depth < 100000
)
SELECT c.id, c.depth, r.id IS NOT NULL AND r.stored_at >= ?
FROM chain c LEFT JOIN responses r ON r.id = c.id ORDER BY c.depth
"""
POOL_SIZE = 4
PRUNE_ROUNDS = 50  # at most this many delete rounds per write (each drops ~10% of rows)


class StoreError(Exception):
    """The database cannot be used (corrupt, unwritable, from a newer version)."""


class StoreBusy(Exception):
    """The database lock was not free within lock_timeout."""


class MissingResponse(Exception):
    """A response id (asked for, or earlier in a previous_response_id chain) is unknown."""

    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id


@dataclass(frozen=True)
class ItemPage:
    items: list[dict[str, Any]]
    has_more: bool


class ResponseStore:
    def __init__(
        self, path: Path, max_age_days: float, max_bytes: int, lock_timeout: float
    ) -> None:
        self.path = path
        self.max_age = max_age_days * 86400.0
        self.max_bytes = max_bytes
        self.lock_timeout = lock_timeout
        self._idle: list[sqlite3.Connection] = []
        self._lock = os_lock()
        self._offhub = OffHub(POOL_SIZE)

    # ---------------------------------------------------------------- connections

    def open_checked(self, deep: bool = True) -> None:
        """Create or check the database now (`deep`: also every page, as at start-up):
        raises StoreError saying what is wrong."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = self._connect()
            try:
                row = conn.execute("PRAGMA quick_check").fetchone() if deep else ("ok",)
                if row is None or row[0] != "ok":
                    raise StoreError(f"the database is corrupt ({row[0] if row else 'no answer'})")
                with self._write(conn):  # proves the file (and its folder) can be written
                    conn.execute(
                        "INSERT OR REPLACE INTO meta VALUES ('opened_at', ?)", (str(time.time()),)
                    )
            finally:
                conn.close()
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(str(exc)) from exc

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self.path, timeout=self.lock_timeout, isolation_level=None, check_same_thread=False
        )
        conn.execute(f"PRAGMA busy_timeout = {int(self.lock_timeout * 1000)}")
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute("PRAGMA synchronous = NORMAL")  # WAL: durable at checkpoints, never corrupt
        try:
            self._init_schema(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _init_schema(self, conn: sqlite3.Connection) -> None:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"the database has schema version {version}, newer than this pipeserve's"
                f" {SCHEMA_VERSION}"
            )
        if version == SCHEMA_VERSION:
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if mode != "wal":
                raise StoreError(f"cannot switch the database to WAL mode (got {mode})")
            return
        conn.execute("PRAGMA auto_vacuum = INCREMENTAL")  # before the first table exists
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if mode != "wal":
            raise StoreError(f"cannot switch the database to WAL mode (got {mode})")
        conn.executescript(
            f"BEGIN IMMEDIATE; {SCHEMA} PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;"
        )

    @contextmanager
    def _write(self, conn: sqlite3.Connection) -> Iterator[None]:
        """One write transaction; the lock is taken at BEGIN, waiting at most lock_timeout."""
        if conn.in_transaction:
            yield
            return
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                raise StoreBusy(str(exc)) from exc
            raise
        try:
            yield
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    @contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = self._connect()
        try:
            yield conn
        except BaseException:
            conn.close()  # its state is unknown: do not pool it
            raise
        with self._lock:
            self._idle.append(conn)

    def _run(self, fn: Any, *args: Any) -> Any:
        def with_connection() -> Any:
            with self._connection() as conn:
                return fn(conn, *args)

        try:
            return self._offhub.run(with_connection)
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                raise StoreBusy(str(exc)) from exc
            raise

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    # ---------------------------------------------------------------- public calls

    def save(
        self,
        response: dict[str, Any],
        input_items: Sequence[dict[str, Any]],
        previous_id: str | None,
    ) -> None:
        """Store a response (its `output` as items) with its own input items."""
        self._run(self._save, response, list(input_items), previous_id)

    def get(self, response_id: str) -> dict[str, Any] | None:
        """The stored Response object with its output, None when unknown or expired."""
        result: dict[str, Any] | None = self._run(self._get, response_id)
        return result

    def delete(self, response_id: str) -> bool:
        deleted: bool = self._run(self._delete, response_id)
        return deleted

    def input_items(
        self, response_id: str, after: str | None, limit: int, order: Literal["asc", "desc"]
    ) -> ItemPage | None:
        """One page of a response's input items; None when the response is unknown."""
        page: ItemPage | None = self._run(self._input_items, response_id, after, limit, order)
        return page

    def items(self, item_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """Stored items by id (the most recently stored one when ids repeat)."""
        found: dict[str, dict[str, Any]] = self._run(self._items, list(item_ids))
        return found

    def history(self, response_id: str) -> list[dict[str, Any]]:
        """Input and output items of the chain ending at `response_id`, oldest first.
        Raises MissingResponse naming the first id of the chain that is gone."""
        found: list[dict[str, Any]] = self._run(self._history, response_id)
        return found

    # ---------------------------------------------------------------- SQL

    def _cutoff(self) -> float:
        return time.time() - self.max_age

    def _save(
        self,
        conn: sqlite3.Connection,
        response: dict[str, Any],
        input_items: list[dict[str, Any]],
        previous_id: str | None,
    ) -> None:
        body = {key: value for key, value in response.items() if key != "output"}
        rows = [("input", i, item) for i, item in enumerate(input_items)]
        rows += [("output", i, item) for i, item in enumerate(response.get("output") or [])]
        with self._write(conn):
            conn.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?)",
                (response["id"], time.time(), previous_id, _dump(body)),
            )
            conn.executemany(
                "INSERT INTO items VALUES (?, ?, ?, ?, ?)",
                [
                    (response["id"], source, i, str(item.get("id", "")), _dump(item))
                    for source, i, item in rows
                ],
            )
            self._prune(conn)

    def _prune(self, conn: sqlite3.Connection) -> None:
        conn.execute("DELETE FROM responses WHERE stored_at < ?", (self._cutoff(),))
        for _ in range(PRUNE_ROUNDS):
            if self._used_bytes(conn) <= self.max_bytes:
                break
            count = conn.execute("SELECT count(*) FROM responses").fetchone()[0]
            if count <= 1:
                break
            conn.execute(
                "DELETE FROM responses WHERE id IN"
                " (SELECT id FROM responses ORDER BY stored_at LIMIT ?)",
                (max(1, count // 10),),
            )
            conn.execute("PRAGMA incremental_vacuum")

    @staticmethod
    def _used_bytes(conn: sqlite3.Connection) -> int:
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        free = conn.execute("PRAGMA freelist_count").fetchone()[0]
        size = conn.execute("PRAGMA page_size").fetchone()[0]
        return int((pages - free) * size)

    def _get(self, conn: sqlite3.Connection, response_id: str) -> dict[str, Any] | None:
        row = conn.execute(
            "SELECT body FROM responses WHERE id = ? AND stored_at >= ?",
            (response_id, self._cutoff()),
        ).fetchone()
        if row is None:
            return None
        output = conn.execute(
            "SELECT body FROM items WHERE response_id = ? AND source = 'output' ORDER BY position",
            (response_id,),
        ).fetchall()
        body: dict[str, Any] = json.loads(row[0])
        body["output"] = [json.loads(item) for (item,) in output]
        return body

    def _delete(self, conn: sqlite3.Connection, response_id: str) -> bool:
        with self._write(conn):
            cursor = conn.execute(
                "DELETE FROM responses WHERE id = ? AND stored_at >= ?",
                (response_id, self._cutoff()),
            )
        return cursor.rowcount > 0

    def _input_items(
        self,
        conn: sqlite3.Connection,
        response_id: str,
        after: str | None,
        limit: int,
        order: Literal["asc", "desc"],
    ) -> ItemPage | None:
        if (
            conn.execute(
                "SELECT 1 FROM responses WHERE id = ? AND stored_at >= ?",
                (response_id, self._cutoff()),
            ).fetchone()
            is None
        ):
            return None
        direction = "ASC" if order == "asc" else "DESC"
        rows = conn.execute(
            "SELECT item_id, body FROM items WHERE response_id = ? AND source = 'input'"
            f" ORDER BY position {direction}",
            (response_id,),
        ).fetchall()
        ids = [item_id for item_id, _ in rows]
        start = ids.index(after) + 1 if after in ids else 0
        chosen = rows[start : start + limit]
        return ItemPage([json.loads(body) for _, body in chosen], start + limit < len(rows))

    def _items(self, conn: sqlite3.Connection, item_ids: list[str]) -> dict[str, dict[str, Any]]:
        found: dict[str, dict[str, Any]] = {}
        for item_id in dict.fromkeys(item_ids):
            row = conn.execute(
                "SELECT i.body FROM items i JOIN responses r ON r.id = i.response_id"
                " WHERE i.item_id = ? AND r.stored_at >= ? ORDER BY r.stored_at DESC LIMIT 1",
                (item_id, self._cutoff()),
            ).fetchone()
            if row is not None:
                found[item_id] = json.loads(row[0])
        return found

    def _history(self, conn: sqlite3.Connection, response_id: str) -> list[dict[str, Any]]:
        cutoff = self._cutoff()
        chain = conn.execute(CHAIN, (response_id, cutoff, cutoff)).fetchall()
        if not chain:
            raise MissingResponse(response_id)
        for chain_id, _, present in chain:
            if not present:
                raise MissingResponse(chain_id)
        items: list[dict[str, Any]] = []
        for chain_id, _, _ in reversed(chain):
            rows = conn.execute(
                "SELECT body FROM items WHERE response_id = ? ORDER BY source = 'output', position",
                (chain_id,),
            ).fetchall()
            items += [json.loads(body) for (body,) in rows]
        return items


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


__all__ = ["ItemPage", "MissingResponse", "ResponseStore", "StoreBusy", "StoreError"]
