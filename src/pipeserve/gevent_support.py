"""Whether gevent's monkey patching is active, and work in a gevent thread pool, without
importing gevent."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def gevent_patched(module: str = "threading") -> bool:
    """True when gevent monkey patching replaced `module` in this process."""
    monkey = sys.modules.get("gevent.monkey")
    return bool(monkey and monkey.is_module_patched(module))


def apply_in_pool(pool: Any, fn: Callable[..., T], *args: Any) -> T:
    """`pool.apply(fn, args)` on a gevent ThreadPool, `fn`'s exception raised here only.

    gevent also hands an exception raised in the pool to the hub's error handler, which
    prints its traceback: every expected error (a json_schema that cannot compile, a
    missing stored response: a 400 each) would leave one in the server's log."""

    def outcome() -> tuple[bool, Any]:
        try:
            return True, fn(*args)
        except Exception as exc:
            return False, exc

    ok, value = pool.apply(outcome)
    if not ok:
        raise value
    result: T = value
    return result
