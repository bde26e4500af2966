"""Everything that must bypass gevent's monkey patching, in one place, without importing
gevent where it is not loaded.

Under gunicorn's gevent workers `threading`, `queue`, `socket`, `time` and `os` are
patched: their blocking calls yield to the hub of the main thread. An engine thread is a
real OS thread that must block the OS thread instead (docs/architecture.md, "Threading
model"), so it uses the originals these helpers return. Request greenlets use
`run_off_hub` for blocking work that must not stall every other request of the worker.
"""

from __future__ import annotations

import importlib
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


def gevent_patched(module: str = "threading") -> bool:
    """True when gevent monkey patching replaced `module` in this process."""
    monkey = sys.modules.get("gevent.monkey")
    return bool(monkey and monkey.is_module_patched(module))


def original(module: str, name: str) -> Any:
    """`module.name` as the OS has it: gevent's saved original when gevent is loaded
    (it returns the current attribute for a module it did not patch)."""
    if "gevent.monkey" in sys.modules:
        from gevent import monkey

        return monkey.get_original(module, name)
    return getattr(importlib.import_module(module), name)


def unpatched_os(name: str) -> Any:
    """os.<name> as the OS has it: gevent's versions need the hub of the main thread."""
    return original("os", name)


def os_socket_class() -> Any:
    """socket.socket, unpatched when gevent patched it."""
    return original("socket", "socket")


def os_sleep(seconds: float) -> None:
    """Sleep the OS thread (gevent's sleep would yield to a hub this thread has not)."""
    original("time", "sleep")(seconds)


def start_os_thread(target: Callable[[], None], name: str) -> None:
    """Start `target` on a real (daemon) OS thread, also when threading is a greenlet shim."""
    if gevent_patched():
        original("_thread", "start_new_thread")(target, ())
    else:
        threading.Thread(target=target, name=name, daemon=True).start()


def os_simple_queue() -> Any:
    """A SimpleQueue whose blocking `get` blocks the OS thread (an engine inbox)."""
    if gevent_patched():
        return original("queue", "SimpleQueue")()
    return queue.SimpleQueue()


def os_lock() -> Any:
    """A lock usable from both the engine OS thread and request greenlets."""
    if gevent_patched():
        return original("_thread", "allocate_lock")()
    return threading.Lock()


class OsThreadHost:
    """One real OS thread that runs the callables handed to it, one after another.

    An engine whose model is loaded and unloaded many times (load on demand) runs each
    load on the same thread instead of starting a new one each time: an engine thread
    never exits (see MlxEngine._park), so without a host every reload left one behind.
    """

    def __init__(self, name: str) -> None:
        self._work = os_simple_queue()
        start_os_thread(self._serve, name=name)

    def run(self, target: Callable[[], None]) -> None:
        self._work.put(target)

    def _serve(self) -> None:
        while True:
            self._work.get()()


class OsFlag:
    """A one-shot flag an OS thread can wait on (e.g. "model loaded").

    Built on a raw lock: threading.Event, even gevent's saved original, builds its
    Condition from the patched threading module and would block the hub instead.
    """

    def __init__(self) -> None:
        self._lock = os_lock()
        self._lock.acquire()
        self._set = False

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            return False
        self._lock.release()
        return True


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


def run_off_hub(fn: Callable[[], T]) -> T:
    """Run a blocking call (loading weights, compiling a grammar, joining an engine
    thread) on a real OS thread when serving under gevent, so that only the calling
    greenlet waits, not the whole worker; inline otherwise. Its exception is raised here
    only (gevent's pool would also print its traceback)."""
    if not gevent_patched():
        return fn()
    import gevent

    return apply_in_pool(gevent.get_hub().threadpool, fn)


def interleave(iterators: list[Iterator[T]]) -> Iterator[tuple[int, T]]:
    """The items of several blocking iterators as each comes (one greenlet pulls each),
    with the index of its iterator; an iterator's exception is raised here. Closing this
    generator kills the greenlets, which closes the iterators they were pulling."""
    import gevent
    from gevent.queue import Queue

    items: Queue[tuple[int, bool, Any]] = Queue()

    def pull(index: int, iterator: Iterator[T]) -> None:
        try:
            for item in iterator:
                items.put((index, False, item))
        except Exception as exc:
            items.put((index, True, exc))
            return
        items.put((index, True, None))

    pullers = [gevent.spawn(pull, i, it) for i, it in enumerate(iterators)]
    running = len(pullers)
    try:
        while running:
            index, ended, value = items.get()
            if not ended:
                yield index, value
                continue
            running -= 1
            if value is not None:
                raise value
    finally:
        gevent.killall(pullers)
