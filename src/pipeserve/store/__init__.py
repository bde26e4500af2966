"""Server-side state: the response store of the OpenAI Responses API.

One interface (base.ResponseStore), two backends: SQLite in one file (the default,
sqlite_store.py) and PostgreSQL (`responses_store.url`, postgres_store.py), which
several servers can share. The PostgreSQL module (and psycopg) is imported only where a
config asks for it, and never in the gunicorn master (see check_store_in_child).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pipeserve.config.models import ResponsesStoreOptions, ServerSection
from pipeserve.store.base import (
    ItemPage,
    MissingResponse,
    ResponseStore,
    StoreBusy,
    StoreError,
    StoreUnavailable,
)
from pipeserve.store.sqlite_store import SqliteStore

DEFAULT_FILE = "responses.sqlite3"


def store_path(options: ResponsesStoreOptions, config_dir: Path) -> Path:
    """The configured file: absolute, relative to the config's folder, or in PIPESERVE_HOME."""
    if options.path:
        path = Path(options.path).expanduser()
        return path if path.is_absolute() else config_dir / path
    from pipeserve.settings import pipeserve_home

    return pipeserve_home() / DEFAULT_FILE


def response_store(server: ServerSection, config_dir: Path) -> ResponseStore | None:
    """The store the config asks for (None: `responses_store: false`), not yet opened."""
    options = server.responses_store
    if options is False:
        return None
    bounds = (options.max_age_days, options.max_bytes, options.lock_timeout)
    if options.url is not None:
        from pipeserve.store.postgres_store import PostgresStore

        return PostgresStore(options.url, *bounds)
    return SqliteStore(store_path(options, config_dir), *bounds)


_OPENED: dict[tuple[object, ...], ResponseStore] = {}


def worker_response_store(server: ServerSection, config_dir: Path) -> ResponseStore | None:
    """This process's store for the config, opened (StoreError if it cannot be used).

    The same settings give the same store object (and its connection pool) across config
    reloads; new settings are checked when first used, so a reload to a store that
    cannot be written fails (and the running config stays) instead of failing requests.
    A database that cannot be reached now is not such a failure: the worker serves, and
    requests that need the store get a 503 until it is back.
    """
    options = server.responses_store
    if options is False:
        return None
    where = options.url or store_path(options, config_dir)
    settings = (options.max_age_days, options.max_bytes, options.lock_timeout)
    key = (os.getpid(), where, *settings)
    if key not in _OPENED:
        store = response_store(server, config_dir)
        assert store is not None
        try:
            store.open_checked(deep=False)
        except StoreUnavailable as exc:
            store.note_unavailable(exc)
        _OPENED[key] = store
    return _OPENED[key]


@dataclass(frozen=True)
class StoreCheck:
    where: str
    problem: str | None = None  # the store cannot be used: do not start
    unreachable: str | None = None  # it cannot be reached now: start, it is retried


def check_store(server: ServerSection, config_dir: Path) -> StoreCheck | None:
    """Create, migrate and check the configured store now (None: no store)."""
    store = response_store(server, config_dir)
    if store is None:
        return None
    try:
        store.open_checked()
    except StoreUnavailable as exc:
        return StoreCheck(store.where, unreachable=str(exc))
    except StoreError as exc:
        return StoreCheck(store.where, problem=str(exc))
    finally:
        store.close()
    return StoreCheck(store.where)


__all__ = [
    "ItemPage",
    "MissingResponse",
    "ResponseStore",
    "SqliteStore",
    "StoreBusy",
    "StoreCheck",
    "StoreError",
    "StoreUnavailable",
    "check_store",
    "response_store",
    "store_path",
    "worker_response_store",
]
