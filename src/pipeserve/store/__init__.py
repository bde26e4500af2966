"""Server-side state: the SQLite response store of the OpenAI Responses API."""

from __future__ import annotations

import os
from pathlib import Path

from pipeserve.config.models import ResponsesStoreOptions, ServerSection
from pipeserve.store.responses_db import (
    ItemPage,
    MissingResponse,
    ResponseStore,
    StoreBusy,
    StoreError,
)

DEFAULT_FILE = "responses.sqlite3"


def store_path(options: ResponsesStoreOptions, config_dir: Path) -> Path:
    """The configured file: absolute, relative to the config's folder, or in PIPESERVE_HOME."""
    if options.path:
        path = Path(options.path).expanduser()
        return path if path.is_absolute() else config_dir / path
    from pipeserve.engine.demo import pipeserve_home

    return pipeserve_home() / DEFAULT_FILE


_OPENED: dict[tuple[object, ...], ResponseStore] = {}


def response_store(server: ServerSection, config_dir: Path) -> ResponseStore | None:
    """The store the config asks for (None: `responses_store: false`), not yet opened."""
    options = server.responses_store
    if options is False:
        return None
    return ResponseStore(
        store_path(options, config_dir),
        options.max_age_days,
        options.max_bytes,
        options.lock_timeout,
    )


def worker_response_store(server: ServerSection, config_dir: Path) -> ResponseStore | None:
    """This process's store for the config, opened and writable (StoreError if not).

    The same settings give the same store object (and its connection pool) across config
    reloads; new settings are checked when first used, so a reload to a store that
    cannot be written fails (and the running config stays) instead of failing requests.
    """
    options = server.responses_store
    if options is False:
        return None
    settings = (options.max_age_days, options.max_bytes, options.lock_timeout)
    key = (os.getpid(), store_path(options, config_dir), *settings)
    if key not in _OPENED:
        store = response_store(server, config_dir)
        assert store is not None
        store.open_checked(deep=False)
        _OPENED[key] = store
    return _OPENED[key]


__all__ = [
    "ItemPage",
    "MissingResponse",
    "ResponseStore",
    "StoreBusy",
    "StoreError",
    "response_store",
    "store_path",
    "worker_response_store",
]
