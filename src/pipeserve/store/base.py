"""The response store's interface, and its calls written once for both SQL backends.

A store keeps OpenAI Response objects (without their output) as rows of `responses` and
their input and output items as rows of `items`, found by their own ids for
item_reference. A response is written in one transaction with its items, so others see
it whole or not at all; each read is one statement (one snapshot, one round trip).
Expired rows (older than the age bound) are invisible to reads and deleted by writes.

Every response belongs to an `Owner`: the API key that stored it (an opaque id derived
from the key, "" on a server without keys) and the model that answered it. Every read,
continuation, item lookup and delete names the caller's owner: another key's responses,
and responses of models outside the caller's model scope, are as unknown as missing ones.

Backends (sqlite_store.py, postgres_store.py) supply their connections, write
transactions, table names, placeholder style, the insert and the pruning; they turn
their driver's errors into the exceptions below, which are all callers see.
"""

from __future__ import annotations

import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar, Literal, TypeVar

T = TypeVar("T")
log = logging.getLogger("pipeserve.store")

# The chain of previous_response_id links from one response back to the first (bounded).
CHAIN_CTE = """
WITH RECURSIVE chain (id, depth) AS (
    SELECT id, 0 FROM {responses} r WHERE id = ? AND stored_at >= ? AND owner_key = ?{scope}
    UNION ALL
    SELECT r.previous_id, c.depth + 1 FROM chain c JOIN {responses} r ON r.id = c.id
    WHERE r.previous_id IS NOT NULL AND c.depth < 100000
)
"""
# Each link of the chain, oldest first, whether it is still there (else a gap: deleted
# or expired), with its items: one statement, so one snapshot and one round trip.
CHAIN_ITEMS = (
    CHAIN_CTE
    + """, links AS (
    SELECT c.id, c.depth,
        r.id IS NOT NULL AND r.stored_at >= ? AND r.owner_key = ?{scope} AS present
    FROM chain c LEFT JOIN {responses} r ON r.id = c.id
)
SELECT l.id, l.depth, l.present, i.body FROM links l
LEFT JOIN {items} i ON i.response_id = l.id AND l.present
ORDER BY l.depth DESC, i.source = 'output', i.position"""
)
ITEMS_PER_QUERY = 200  # item ids looked up per query (SQLite bounds the parameters)
PRUNE_ROUNDS = 50  # at most this many delete rounds per write (each drops ~10% of rows)


class StoreError(Exception):
    """The database cannot be used (corrupt, unwritable, from a newer version, a fault)."""


class StoreUnavailable(StoreError):
    """The database cannot be reached now (down, no connection in time): retry later."""


class StoreBusy(StoreUnavailable):
    """The database lock was not free within lock_timeout."""


class MissingResponse(Exception):
    """A response id (asked for, or earlier in a previous_response_id chain) is unknown."""

    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id


@dataclass(frozen=True)
class Owner:
    """Whose responses a call may see: `key` is the storing API key's opaque id ("" for a
    server without keys); `models` the models it may use (None: every model)."""

    key: str = ""
    models: frozenset[str] | None = None

    def scope(self, column: str) -> tuple[str, tuple[str, ...]]:
        """An SQL condition (with its parameters) limiting `column` to the model scope."""
        if self.models is None:
            return "", ()
        if not self.models:
            return " AND 1 = 0", ()
        names = tuple(sorted(self.models))
        return f" AND {column} IN ({', '.join('?' * len(names))})", names


NOBODY_IN_PARTICULAR = Owner()  # a server without API keys


@dataclass(frozen=True)
class ItemPage:
    items: list[dict[str, Any]]
    has_more: bool


@dataclass(frozen=True)
class Row:
    """One stored item: which list it is in, its place there, its id, its JSON."""

    source: Literal["input", "output"]
    position: int
    item_id: str
    body: str


class ResponseStore(ABC):
    """One store; every call is safe from any greenlet or thread of the process."""

    RESPONSES: ClassVar[str] = "responses"
    ITEMS: ClassVar[str] = "items"
    PARAM: ClassVar[str] = "?"  # the driver's placeholder

    def __init__(self, max_age_days: float, max_bytes: int, lock_timeout: float) -> None:
        self.max_age = max_age_days * 86400.0
        self.max_bytes = max_bytes
        self.lock_timeout = lock_timeout
        self._outage = False  # its start is logged, its end not yet

    # ------------------------------------------------------------ the backend's part

    @property
    @abstractmethod
    def where(self) -> str:
        """The database, for logs and messages (never a password)."""

    @abstractmethod
    def open_checked(self, deep: bool = True) -> None:
        """Create or migrate the schema and check the database now (`deep`: thoroughly, as
        at start-up). StoreUnavailable: it cannot be reached now; StoreError: unusable."""

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def _run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(connection, *args) on a pooled connection, driver errors translated."""

    @abstractmethod
    def _writing(self, conn: Any) -> AbstractContextManager[None]:
        """One write transaction, waiting at most lock_timeout for locks (StoreBusy)."""

    @abstractmethod
    def _insert(self, conn: Any, response_id: str, previous_id: str | None, body: str,
                rows: list[Row], owner: str, model: str) -> None:  # fmt: skip
        """Write (or replace) one response (stored by `owner`, answered by `model`) and
        its item rows."""

    @abstractmethod
    def _prune(self, conn: Any) -> None:
        """Delete what is older than the age bound, then the oldest beyond the size bound."""

    @abstractmethod
    def _delete_one(self, conn: Any, response_id: str, owner: Owner) -> bool: ...

    # ------------------------------------------------------------ outages

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """`_run`, logging when the database becomes unreachable and when it is back."""
        try:
            result = self._run(fn, *args)
        except StoreBusy:
            raise
        except StoreUnavailable as exc:
            self.note_unavailable(exc)
            raise
        if self._outage:
            self._outage = False
            log.warning("the response store %s can be reached again", self.where)
        return result

    def note_unavailable(self, exc: StoreUnavailable) -> None:
        """Log why the database cannot be reached, once per outage (clients get a bare 503
        without it: it names the database's user, host and port)."""
        if not self._outage:
            self._outage = True
            log.warning(
                "the response store cannot be reached (%s); requests that need it get a 503"
                " until it is back (retried by itself)",
                exc,
            )

    # ------------------------------------------------------------ public calls

    def save(
        self,
        response: dict[str, Any],
        input_items: Sequence[dict[str, Any]],
        previous_id: str | None,
        owner: Owner = NOBODY_IN_PARTICULAR,
        model: str | None = None,
    ) -> None:
        """Store a response (its `output` as items) with its own input items, owned by
        `owner.key` and answered by `model` (default: the response's `model`)."""
        served = str(response.get("model") or "") if model is None else model
        self._call(self._save, response, list(input_items), previous_id, owner.key, served)

    def get(self, response_id: str, owner: Owner = NOBODY_IN_PARTICULAR) -> dict[str, Any] | None:
        """The stored Response object with its output, None when unknown, expired or not
        the owner's."""
        return self._call(self._get, response_id, owner)

    def delete(self, response_id: str, owner: Owner = NOBODY_IN_PARTICULAR) -> bool:
        return self._call(self._delete, response_id, owner)

    def input_items(
        self,
        response_id: str,
        after: str | None,
        limit: int,
        order: Literal["asc", "desc"],
        owner: Owner = NOBODY_IN_PARTICULAR,
    ) -> ItemPage | None:
        """One page of a response's input items; None when the response is unknown."""
        return self._call(self._input_items, response_id, after, limit, order, owner)

    def items(
        self, item_ids: Sequence[str], owner: Owner = NOBODY_IN_PARTICULAR
    ) -> dict[str, dict[str, Any]]:
        """The owner's stored items by id: an output item (its id made by the server)
        before an input item sent with the same id, else the most recently stored one."""
        return self._call(self._items, list(item_ids), owner)

    def history(
        self, response_id: str, owner: Owner = NOBODY_IN_PARTICULAR
    ) -> list[dict[str, Any]]:
        """Input and output items of the owner's chain ending at `response_id`, oldest
        first. Raises MissingResponse naming the first id of the chain that is gone (or
        not the owner's)."""
        return self._call(self._history, response_id, owner)

    # ------------------------------------------------------------ SQL

    @classmethod
    def sql(cls, text: str) -> str:
        """`text` with this backend's table names and placeholder."""
        return _dialect(text, cls.RESPONSES, cls.ITEMS, cls.PARAM)

    def cutoff(self) -> float:
        return time.time() - self.max_age

    def _save(
        self,
        conn: Any,
        response: dict[str, Any],
        input_items: list[dict[str, Any]],
        previous_id: str | None,
        owner: str,
        model: str,
    ) -> None:
        body = dump({key: value for key, value in response.items() if key != "output"})
        rows = [_row("input", i, item) for i, item in enumerate(input_items)]
        rows += [_row("output", i, item) for i, item in enumerate(response.get("output") or [])]
        with self._writing(conn):
            self._insert(conn, response["id"], previous_id, body, rows, owner, model)
            self._prune(conn)

    def _delete(self, conn: Any, response_id: str, owner: Owner) -> bool:
        with self._writing(conn):
            return self._delete_one(conn, response_id, owner)

    def _get(self, conn: Any, response_id: str, owner: Owner) -> dict[str, Any] | None:
        """One statement (so one snapshot): the body on every row, with each output item."""
        scope, models = owner.scope("r.model")
        rows = conn.execute(
            self.sql(
                "SELECT r.body, i.body FROM {responses} r LEFT JOIN {items} i"
                " ON i.response_id = r.id AND i.source = 'output'"
                f" WHERE r.id = ? AND r.stored_at >= ? AND r.owner_key = ?{scope}"
                " ORDER BY i.position"
            ),
            (response_id, self.cutoff(), owner.key, *models),
        ).fetchall()
        if not rows:
            return None
        body: dict[str, Any] = json.loads(rows[0][0])
        body["output"] = [json.loads(item) for _, item in rows if item is not None]
        return body

    def _input_items(
        self,
        conn: Any,
        response_id: str,
        after: str | None,
        limit: int,
        order: Literal["asc", "desc"],
        owner: Owner,
    ) -> ItemPage | None:
        direction = "ASC" if order == "asc" else "DESC"
        scope, models = owner.scope("r.model")
        rows = conn.execute(
            self.sql(
                "SELECT i.item_id, i.body FROM {responses} r LEFT JOIN {items} i"
                " ON i.response_id = r.id AND i.source = 'input'"
                f" WHERE r.id = ? AND r.stored_at >= ? AND r.owner_key = ?{scope}"
                f" ORDER BY i.position {direction}"
            ),
            (response_id, self.cutoff(), owner.key, *models),
        ).fetchall()
        if not rows:
            return None
        rows = [(item_id, body) for item_id, body in rows if body is not None]
        ids = [item_id for item_id, _ in rows]
        start = ids.index(after) + 1 if after in ids else 0
        chosen = rows[start : start + limit]
        return ItemPage([json.loads(body) for _, body in chosen], start + limit < len(rows))

    def _items(self, conn: Any, item_ids: list[str], owner: Owner) -> dict[str, dict[str, Any]]:
        wanted = list(dict.fromkeys(item_ids))
        found: dict[str, dict[str, Any]] = {}
        scope, models = owner.scope("r.model")
        for start in range(0, len(wanted), ITEMS_PER_QUERY):
            some = wanted[start : start + ITEMS_PER_QUERY]
            query = self.sql(
                "SELECT i.item_id, i.body FROM {items} i JOIN {responses} r"
                f" ON r.id = i.response_id WHERE i.item_id IN ({', '.join('?' * len(some))})"
                f" AND r.stored_at >= ? AND r.owner_key = ?{scope}"
                " ORDER BY i.source = 'output', r.stored_at"
            )
            params = (*some, self.cutoff(), owner.key, *models)
            for item_id, body in conn.execute(query, params).fetchall():
                found[item_id] = json.loads(body)  # output items, then the newest, win
        return found

    def _history(self, conn: Any, response_id: str, owner: Owner) -> list[dict[str, Any]]:
        cutoff = self.cutoff()
        scope, models = owner.scope("r.model")
        query = self.sql(CHAIN_ITEMS.replace("{scope}", scope))
        params = (response_id, cutoff, owner.key, *models, cutoff, owner.key, *models)
        rows = conn.execute(query, params).fetchall()
        if not rows:
            raise MissingResponse(response_id)
        gaps = [(depth, link) for link, depth, present, _ in rows if not present]
        if gaps:
            raise MissingResponse(min(gaps)[1])  # the gap nearest the response asked for
        return [json.loads(body) for *_, body in rows if body is not None]


@cache
def _dialect(text: str, responses: str, items: str, param: str) -> str:
    return text.format(responses=responses, items=items).replace("?", param)


def _row(source: Literal["input", "output"], position: int, item: dict[str, Any]) -> Row:
    return Row(source, position, str(item.get("id", "")), dump(item))


def dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def schema_too_new(where: str, found: int, known: int) -> StoreError:
    return StoreError(
        f"{where} has schema version {found}, newer than the {known} this pipeserve"
        " understands (a newer pipeserve wrote it): upgrade pipeserve, or use another store"
    )


__all__ = [
    "PRUNE_ROUNDS",
    "ItemPage",
    "NOBODY_IN_PARTICULAR",
    "MissingResponse",
    "Owner",
    "ResponseStore",
    "Row",
    "StoreBusy",
    "StoreError",
    "StoreUnavailable",
    "dump",
    "schema_too_new",
]
