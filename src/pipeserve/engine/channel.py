"""Handing events from an engine OS thread to the request that waits for them.

Under gevent (monkey patched) the waiting request is a greenlet on the hub of its
thread: the engine thread must never touch gevent objects directly, so it batches a
decode step's events for all requests and schedules ONE callback on each hub with
`loop.run_callback_threadsafe`, which then fills per-request `gevent.queue.Queue`s
(docs/architecture.md, "Threading model"). Without gevent a plain `queue.SimpleQueue`
per request is enough.

Also here: the real-OS-thread, queue and lock primitives, which gevent patches away.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from pipeserve.events import Event
from pipeserve.gevent_support import gevent_patched


def _original(module: str, name: str) -> Any:
    from gevent import monkey

    return monkey.get_original(module, name)


def start_os_thread(target: Callable[[], None], name: str) -> None:
    """Start `target` on a real (daemon) OS thread, also when threading is a greenlet shim."""
    if gevent_patched():
        _original("_thread", "start_new_thread")(target, ())
    else:
        threading.Thread(target=target, name=name, daemon=True).start()


def os_simple_queue() -> Any:
    """A SimpleQueue whose blocking `get` blocks the OS thread (an engine inbox)."""
    if gevent_patched():
        return _original("queue", "SimpleQueue")()
    return queue.SimpleQueue()


def os_lock() -> Any:
    """A lock usable from both the engine OS thread and request greenlets."""
    if gevent_patched():
        return _original("_thread", "allocate_lock")()
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


_HUB_POLL = 1.0


class Channel:
    """One request's mailbox. Items are lists of events (one list per engine step)."""

    def __init__(self) -> None:
        self.hub: Any = None
        if gevent_patched():
            import gevent
            import gevent.queue

            self.hub = gevent.get_hub()
            self._queue: Any = gevent.queue.Queue()
        else:
            self._queue = queue.SimpleQueue()

    def get(self, timeout: float | None) -> list[Event] | None:
        """Next batch of events, or None after `timeout` seconds of silence."""
        while True:
            try:
                # gevent raises LoopExit on an untimed wait when nothing else keeps the
                # hub alive: it cannot know the engine thread will call back.
                wait = timeout if timeout is not None or self.hub is None else _HUB_POLL
                batch: list[Event] | None = self._queue.get(timeout=wait)
                return batch
            except queue.Empty:  # gevent.queue.Empty is the same class
                if timeout is not None:
                    return None


def _deliver(batch: list[tuple[Channel, list[Event]]]) -> None:
    for channel, events in batch:
        channel._queue.put(events)


class Courier:
    """Collects one engine step's events and delivers them with one hop per hub."""

    def __init__(self) -> None:
        self._pending: dict[int, tuple[Channel, list[Event]]] = {}

    def post(self, channel: Channel, *events: Event) -> None:
        entry = self._pending.get(id(channel))
        if entry is None:
            self._pending[id(channel)] = (channel, list(events))
        else:
            entry[1].extend(events)

    def flush(self) -> None:
        if not self._pending:
            return
        by_hub: dict[int, tuple[Any, list[tuple[Channel, list[Event]]]]] = {}
        for channel, events in self._pending.values():
            if channel.hub is None:
                channel._queue.put(events)
                continue
            by_hub.setdefault(id(channel.hub), (channel.hub, []))[1].append((channel, events))
        self._pending = {}
        for hub, batch in by_hub.values():
            hub.loop.run_callback_threadsafe(_deliver, batch)
