"""Run blocking calls (SQLite) off the gevent hub, on a few real OS threads.

sqlite3 is C code that gevent cannot patch: a busy wait for a database lock, or a slow
disk, would stop every greenlet of the worker. Under gevent each call runs on a small
dedicated thread pool and only the calling greenlet waits; without gevent it runs inline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pipeserve.gevent_support import apply_in_pool, gevent_patched

T = TypeVar("T")
POOL_THREADS = 4


class OffHub:
    """One pool per process, made on first use (after gunicorn's fork)."""

    def __init__(self, threads: int = POOL_THREADS) -> None:
        self.threads = threads
        self._pool: Any = None

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        if not gevent_patched():
            return fn(*args)
        if self._pool is None:
            from gevent.threadpool import ThreadPool

            self._pool = ThreadPool(self.threads)
        return apply_in_pool(self._pool, fn, *args)


__all__ = ["OffHub"]
