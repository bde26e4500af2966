"""The response store in PostgreSQL, for several servers sharing one store.

psycopg 3 with a psycopg_pool connection pool per worker. Under gevent psycopg waits
cooperatively (it picks its wait functions when first imported, so it must be imported
after gevent's monkey patching: never in the gunicorn master, see serving.py), so calls
run on the calling greenlet and the pool's helpers are greenlets too.

- Bounds: every wait for a lock (`lock_timeout`), for a pooled connection, and every
  statement (a few times `lock_timeout`) is bounded; then StoreBusy / StoreUnavailable.
- Faults: the pool checks a connection before handing it out (without a round trip) and
  replaces broken ones in the background, so after the database comes back the store
  works again by itself.
- Size: each response row records the bytes it and its items hold; triggers keep their
  total in one counter row, whatever inserts or deletes rows (pruning, DELETE, an
  operator's own SQL). Writers queue on that row only for their short transaction: a
  save is one pipelined round trip, then its commit.
- Schema: the applied versions are rows of pipeserve_schema; migrations run in one
  transaction under an advisory lock, so servers starting together apply each once.
"""

from __future__ import annotations

import atexit
import logging
import select
import selectors
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar
from urllib.parse import urlsplit

import psycopg
from psycopg import errors, waiting
from psycopg_pool import ConnectionPool, PoolTimeout

from pipeserve.gevent_support import gevent_patched
from pipeserve.store.base import (
    PRUNE_ROUNDS,
    Owner,
    ResponseStore,
    Row,
    StoreBusy,
    StoreError,
    StoreUnavailable,
    schema_too_new,
)

T = TypeVar("T")
log = logging.getLogger("pipeserve.store")

SCHEMA_VERSION = 2
MIGRATION_LOCK = 0x70697065_73657276  # "pipeserv": the advisory lock of schema changes
MIGRATION_TIMEOUT_MS = 60_000  # another server migrating: wait this long for it
# Migration N takes the database from version N-1 to N (inside one transaction).
MIGRATIONS: dict[int, str] = {
    1: """
CREATE TABLE pipeserve_responses (
    id text PRIMARY KEY,
    stored_at double precision NOT NULL,
    previous_id text,
    size bigint NOT NULL,
    body text NOT NULL
);
CREATE INDEX pipeserve_responses_by_age ON pipeserve_responses (stored_at);
CREATE TABLE pipeserve_items (
    response_id text NOT NULL REFERENCES pipeserve_responses (id) ON DELETE CASCADE,
    source text NOT NULL CHECK (source IN ('input', 'output')),
    position integer NOT NULL,
    item_id text NOT NULL,
    body text NOT NULL,
    PRIMARY KEY (response_id, source, position)
);
CREATE INDEX pipeserve_items_by_id ON pipeserve_items (item_id);
CREATE TABLE pipeserve_usage (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    bytes bigint NOT NULL
);
INSERT INTO pipeserve_usage VALUES (true, 0);
CREATE FUNCTION pipeserve_count_added() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE pipeserve_usage SET bytes = bytes + (SELECT coalesce(sum(size), 0) FROM added);
    RETURN NULL;
END $$;
CREATE FUNCTION pipeserve_count_removed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM removed) THEN
        UPDATE pipeserve_usage SET bytes = bytes - (SELECT coalesce(sum(size), 0) FROM removed);
    END IF;
    RETURN NULL;
END $$;
CREATE FUNCTION pipeserve_count_cleared() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE pipeserve_usage SET bytes = 0;
    RETURN NULL;
END $$;
CREATE TRIGGER pipeserve_responses_added AFTER INSERT ON pipeserve_responses
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION pipeserve_count_added();
CREATE TRIGGER pipeserve_responses_removed AFTER DELETE ON pipeserve_responses
    REFERENCING OLD TABLE AS removed FOR EACH STATEMENT
    EXECUTE FUNCTION pipeserve_count_removed();
CREATE TRIGGER pipeserve_responses_cleared AFTER TRUNCATE ON pipeserve_responses
    FOR EACH STATEMENT EXECUTE FUNCTION pipeserve_count_cleared();
""",
    # Responses owned by the API key that stored them (base.Owner). Rows stored before
    # belong to the server without keys (""): no key sees them once keys are configured.
    2: """
ALTER TABLE pipeserve_responses ADD COLUMN owner_key text NOT NULL DEFAULT '',
    ADD COLUMN model text NOT NULL DEFAULT '';
UPDATE pipeserve_responses SET model = coalesce(body::jsonb ->> 'model', '');
""",
}
POOL_MAX = 8
RECONNECT_TIMEOUT = 10.0  # then a pool slot gives up; the next request starts a new try
CLOSE_TIMEOUT = 1.0  # seconds the pool's helpers get to stop at close
STATEMENT_TIMEOUT_FACTOR = 5  # a statement may run this many times lock_timeout


class _QuietReconnects(logging.Filter):
    """The pool logs each failed connection attempt (several a second while the database
    is down); the store logs the outage once instead (ResponseStore.note_unavailable)."""

    PER_ATTEMPT = ("error connecting in ", "reconnection attempt in pool ")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.PER_ATTEMPT)


logging.getLogger("psycopg.pool").addFilter(_QuietReconnects())


def display_url(url: str) -> str:
    """The URL without its password (and query), for logs and messages."""
    parts = urlsplit(url)
    user = f"{parts.username}@" if parts.username else ""
    host = parts.hostname or "local socket"
    port = f":{parts.port}" if parts.port else ""
    return f"PostgreSQL {parts.scheme}://{user}{host}{port}{parts.path}"


class PostgresStore(ResponseStore):
    RESPONSES = "pipeserve_responses"
    ITEMS = "pipeserve_items"
    PARAM = "%s"

    def __init__(self, url: str, max_age_days: float, max_bytes: int, lock_timeout: float) -> None:
        super().__init__(max_age_days, max_bytes, lock_timeout)
        self.url = url
        self._pool: ConnectionPool | None = None
        self._schema_ready = False
        self.connect_failure: str | None = None  # why the pool's last connection attempt failed

    @property
    def where(self) -> str:
        return display_url(self.url)

    # ---------------------------------------------------------------- connections

    def open_checked(self, deep: bool = True) -> None:
        """`deep` (start-up, one process): one plain connection, migrated, then closed.
        Otherwise (a worker): open the pool, then check it as any request would."""
        if deep:
            try:
                with psycopg.connect(self.url, autocommit=True, **self._connect_options()) as conn:
                    self._configure(conn)
                    self._migrate(conn)
            except psycopg.Error as exc:
                raise _translated(exc, self.where) from exc
            return
        self._open_pool()
        self._run(lambda conn: None)

    def _connect_options(self) -> dict[str, Any]:
        return {"connect_timeout": max(2, round(self.lock_timeout)),
                "application_name": "pipeserve"}  # fmt: skip

    def _configure(self, conn: psycopg.Connection[Any]) -> None:
        ms = int(self.lock_timeout * 1000)
        conn.execute(f"SET lock_timeout = {ms}")
        conn.execute(f"SET statement_timeout = {ms * STATEMENT_TIMEOUT_FACTOR}")

    def _open_pool(self) -> ConnectionPool:
        if self._pool is None:
            _check_cooperative()
            self._pool = ConnectionPool(
                self.url,
                connection_class=_recording_failures(self),
                kwargs={"autocommit": True, **self._connect_options()},
                min_size=1,
                max_size=POOL_MAX,
                open=False,
                configure=self._configure,
                check=_unbroken,
                timeout=self.lock_timeout,
                reconnect_timeout=RECONNECT_TIMEOUT,
                name="pipeserve-responses",
            )
            self._pool.open(wait=False)
            # Closed while the process still runs its hub: a pool left to the interpreter's
            # finalization trips over its already finalized greenlets (a traceback per exit).
            atexit.register(self.close)
        return self._pool

    def _migrate(self, conn: psycopg.Connection[Any]) -> None:
        version = _version(conn)
        if version == SCHEMA_VERSION:
            return
        if version > SCHEMA_VERSION:
            raise schema_too_new(self.where, version, SCHEMA_VERSION)
        with conn.transaction():
            for setting in ("lock_timeout", "statement_timeout"):
                conn.execute(f"SET LOCAL {setting} = {MIGRATION_TIMEOUT_MS}")
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            conn.execute(
                "CREATE TABLE IF NOT EXISTS pipeserve_schema (version integer PRIMARY KEY,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            )
            version = _version(conn)  # another server may have migrated meanwhile
            if version > SCHEMA_VERSION:
                raise schema_too_new(self.where, version, SCHEMA_VERSION)
            for step in range(version + 1, SCHEMA_VERSION + 1):
                conn.execute(MIGRATIONS[step])
                conn.execute("INSERT INTO pipeserve_schema (version) VALUES (%s)", (step,))
                log.info("%s: response store schema migrated to version %d", self.where, step)

    def _run(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            with self._open_pool().connection() as conn:
                if not self._schema_ready:
                    self._migrate(conn)
                    self._schema_ready = True
                return fn(conn, *args)
        except PoolTimeout as exc:
            message = f"{self.where}: no working connection within {self.lock_timeout:g} s"
            if self.connect_failure:
                message += f" (last attempt: {self.connect_failure})"
            raise StoreUnavailable(message) from exc
        except psycopg.Error as exc:
            raise _translated(exc, self.where) from exc

    @contextmanager
    def _writing(self, conn: psycopg.Connection[Any]) -> Iterator[None]:
        """Pipelined: statements go out together, and wait only where a result is read."""
        with conn.pipeline(), conn.transaction():
            yield

    def close(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.close(timeout=CLOSE_TIMEOUT)

    # ---------------------------------------------------------------- writes

    def _insert(
        self, conn: psycopg.Connection[Any], response_id: str, previous_id: str | None,
        body: str, rows: list[Row], owner: str, model: str,
    ) -> None:  # fmt: skip
        size = len(body.encode()) + sum(len(r.body.encode()) for r in rows)
        conn.execute("DELETE FROM pipeserve_responses WHERE id = %s", (response_id,))
        conn.execute(
            "INSERT INTO pipeserve_responses (id, stored_at, previous_id, size, body, owner_key,"
            " model) VALUES (%s, %s, %s, %s, %s, %s, %s)",
            (response_id, time.time(), previous_id, size, body, owner, model),
        )
        with conn.cursor() as cursor:
            cursor.executemany(
                "INSERT INTO pipeserve_items VALUES (%s, %s, %s, %s, %s)",
                [(response_id, r.source, r.position, r.item_id, r.body) for r in rows],
            )
        conn.execute(
            "DELETE FROM pipeserve_responses WHERE id IN (SELECT id FROM pipeserve_responses"
            " WHERE stored_at < %s FOR UPDATE SKIP LOCKED)",
            (self.cutoff(),),
        )

    def _prune(self, conn: psycopg.Connection[Any]) -> None:
        """The oldest first beyond the size bound; rows other transactions hold are skipped
        (they are being deleted). Expired rows went with the insert."""
        for _ in range(PRUNE_ROUNDS):
            if int(_scalar(conn, "SELECT bytes FROM pipeserve_usage")) <= self.max_bytes:
                break
            count = int(_scalar(conn, "SELECT count(*) FROM pipeserve_responses"))
            if count <= 1:
                break
            conn.execute(
                "DELETE FROM pipeserve_responses WHERE id IN (SELECT id FROM pipeserve_responses"
                " ORDER BY stored_at LIMIT %s FOR UPDATE SKIP LOCKED)",
                (max(1, count // 10),),
            )

    def _delete_one(self, conn: psycopg.Connection[Any], response_id: str, owner: Owner) -> bool:
        scope, models = owner.scope("model")
        deleted = conn.execute(
            "DELETE FROM pipeserve_responses WHERE id = %s AND stored_at >= %s AND owner_key = %s"
            + scope.replace("?", "%s")
            + " RETURNING 1",
            (response_id, self.cutoff(), owner.key, *models),
        ).fetchall()
        return bool(deleted)


def _scalar(conn: psycopg.Connection[Any], query: str) -> Any:
    row = conn.execute(query).fetchone()
    assert row is not None, query
    return row[0]


def _version(conn: psycopg.Connection[Any]) -> int:
    """The newest applied schema version; 0 for a database pipeserve never used."""
    if _scalar(conn, "SELECT to_regclass('pipeserve_schema')") is None:
        return 0
    return int(_scalar(conn, "SELECT max(version) FROM pipeserve_schema") or 0)


def _translated(exc: psycopg.Error, where: str) -> StoreError:
    """Lock waits and timeouts are StoreBusy; lost or refused connections StoreUnavailable."""
    detail = _detail(exc)
    if isinstance(exc, errors.LockNotAvailable | errors.QueryCanceled | errors.DeadlockDetected):
        return StoreBusy(f"{where}: {detail}")
    if isinstance(exc, psycopg.OperationalError):
        return StoreUnavailable(f"{where}: {detail}")
    return StoreError(f"{where}: {detail}")


def _recording_failures(store: PostgresStore) -> type[psycopg.Connection[Any]]:
    """The pool's connection class, noting in `store` why connecting fails (for the 503)."""

    class Recording(psycopg.Connection[Any]):
        @classmethod
        def connect(cls, *args: Any, **kwargs: Any) -> Any:
            try:
                conn = super().connect(*args, **kwargs)
            except psycopg.Error as exc:
                store.connect_failure = _detail(exc)
                raise
            store.connect_failure = None
            return conn

    return Recording


def _detail(exc: psycopg.Error) -> str:
    """The first line of the driver's message, without its "connection failed: " frame."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return line.removeprefix("connection failed: ")


def _unbroken(conn: psycopg.Connection[Any]) -> None:
    """The pool's check before handing out a connection, without a round trip: an idle
    connection has nothing to read, unless the server ended it (a restart, a terminated
    backend: its goodbye and EOF are waiting). Then it is replaced. A link that died
    silently fails at its first use instead (one 503) and is dropped."""
    if conn.closed or conn.broken:
        raise psycopg.OperationalError("the connection is closed")
    readable, _, _ = select.select([conn.fileno()], [], [], 0)
    if readable:
        conn.close()  # so that the pool drops it rather than taking it back as idle
        raise psycopg.OperationalError("the server ended the connection")


def _check_cooperative() -> None:
    """Under gevent, psycopg must have been imported after the monkey patching: else its
    waits block the whole worker. A bug if not (something imported it too early)."""
    if gevent_patched("select") and (
        waiting.wait is getattr(waiting, "wait_c", None)
        or getattr(waiting, "DefaultSelector", None) is not selectors.DefaultSelector
    ):
        raise StoreError("psycopg was imported before gevent's monkey patching (a bug)")


__all__ = ["SCHEMA_VERSION", "PostgresStore", "display_url"]
