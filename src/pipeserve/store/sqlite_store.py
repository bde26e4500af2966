"""The default response store: one SQLite file on this machine, shared by every worker.

WAL mode lets readers run beside the one writer; writers take the lock up front (BEGIN
IMMEDIATE) and wait at most `lock_timeout` seconds for it (then StoreBusy, a 503). The
size bound counts the file's used pages. The schema version is the file's user_version;
migrations run under the write lock, so servers starting at once apply each only once.

sqlite3 is C code gevent cannot patch: every call runs off the hub (offhub.py), each on
a pooled connection.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from pipeserve.gevent_support import os_lock
from pipeserve.store.base import (
    PRUNE_ROUNDS,
    Owner,
    ResponseStore,
    Row,
    StoreBusy,
    StoreError,
    schema_too_new,
)
from pipeserve.store.offhub import OffHub

T = TypeVar("T")

SCHEMA_VERSION = 2
# Migration N takes a database from version N-1 to N (inside one write transaction).
MIGRATIONS: dict[int, str] = {
    1: """
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
""",
    # Responses owned by the API key that stored them (base.Owner). Rows stored before
    # belong to the server without keys (""): no key sees them once keys are configured.
    2: """
ALTER TABLE responses ADD COLUMN owner_key TEXT NOT NULL DEFAULT '';
ALTER TABLE responses ADD COLUMN model TEXT NOT NULL DEFAULT '';
UPDATE responses SET model = coalesce(json_extract(body, '$.model'), '');
""",
}
POOL_SIZE = 4


def _locked(exc: sqlite3.Error) -> bool:
    return "locked" in str(exc) or "busy" in str(exc)


class SqliteStore(ResponseStore):
    def __init__(
        self, path: Path, max_age_days: float, max_bytes: int, lock_timeout: float
    ) -> None:
        super().__init__(max_age_days, max_bytes, lock_timeout)
        self.path = path
        self._idle: list[sqlite3.Connection] = []
        self._lock = os_lock()
        self._offhub = OffHub(POOL_SIZE)

    @property
    def where(self) -> str:
        return str(self.path)

    # ---------------------------------------------------------------- connections

    def open_checked(self, deep: bool = True) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = self._connect()
            try:
                row = conn.execute("PRAGMA quick_check").fetchone() if deep else ("ok",)
                if row is None or row[0] != "ok":
                    raise StoreError(f"the database is corrupt ({row[0] if row else 'no answer'})")
                with self._writing(conn):  # proves the file (and its folder) can be written
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
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self.lock_timeout * 1000)}")
            conn.execute("PRAGMA foreign_keys = ON")
            conn.execute("PRAGMA synchronous = NORMAL")  # WAL: durable at checkpoints
            self._migrate(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _migrate(self, conn: sqlite3.Connection) -> None:
        version = _version(conn)
        if version > SCHEMA_VERSION:
            raise schema_too_new(self.where, version, SCHEMA_VERSION)
        if version == 0:
            conn.execute("PRAGMA auto_vacuum = INCREMENTAL")  # before the first table exists
        mode = self._switch_to_wal(conn)
        if mode != "wal":
            raise StoreError(f"cannot switch the database to WAL mode (got {mode})")
        if version == SCHEMA_VERSION:
            return
        with self._writing(conn):
            version = _version(conn)  # another process may have migrated meanwhile
            for step in range(version + 1, SCHEMA_VERSION + 1):
                for statement in filter(str.strip, MIGRATIONS[step].split(";")):
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {step}")

    def _switch_to_wal(self, conn: sqlite3.Connection) -> str:
        """PRAGMA journal_mode = WAL, retried for up to lock_timeout: SQLite answers
        "database is locked" at once, without its busy handler, while another
        connection is switching the same new file (servers starting together)."""
        deadline = time.monotonic() + self.lock_timeout
        while True:
            try:
                return str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
            except sqlite3.OperationalError as exc:
                if not _locked(exc) or time.monotonic() >= deadline:
                    raise
                time.sleep(0.02)

    @contextmanager
    def _writing(self, conn: sqlite3.Connection) -> Iterator[None]:
        if conn.in_transaction:
            yield
            return
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if _locked(exc):
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

    def _run(self, fn: Callable[..., T], *args: Any) -> T:
        def with_connection() -> T:
            with self._connection() as conn:
                return fn(conn, *args)

        try:
            return self._offhub.run(with_connection)
        except sqlite3.Error as exc:
            if isinstance(exc, sqlite3.OperationalError) and _locked(exc):
                raise StoreBusy(str(exc)) from exc
            raise StoreError(str(exc)) from exc

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    # ---------------------------------------------------------------- writes

    def _insert(
        self, conn: sqlite3.Connection, response_id: str, previous_id: str | None, body: str,
        rows: list[Row], owner: str, model: str,
    ) -> None:  # fmt: skip
        conn.execute(
            "INSERT OR REPLACE INTO responses (id, stored_at, previous_id, body, owner_key, model)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (response_id, time.time(), previous_id, body, owner, model),
        )
        conn.executemany(
            "INSERT INTO items VALUES (?, ?, ?, ?, ?)",
            [(response_id, r.source, r.position, r.item_id, r.body) for r in rows],
        )

    def _prune(self, conn: sqlite3.Connection) -> None:
        conn.execute("DELETE FROM responses WHERE stored_at < ?", (self.cutoff(),))
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

    def _delete_one(self, conn: sqlite3.Connection, response_id: str, owner: Owner) -> bool:
        scope, models = owner.scope("model")
        cursor = conn.execute(
            f"DELETE FROM responses WHERE id = ? AND stored_at >= ? AND owner_key = ?{scope}",
            (response_id, self.cutoff(), owner.key, *models),
        )
        return cursor.rowcount > 0


def _version(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA user_version").fetchone()[0])


__all__ = ["SCHEMA_VERSION", "SqliteStore"]
