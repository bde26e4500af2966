"""Handing events from an engine OS thread to the request that waits for them.

Under gevent (monkey patched) the waiting request is a greenlet on the hub of its
thread: the engine thread must never touch gevent objects directly, so it batches a
decode step's events for all requests and schedules ONE callback on each hub with
`loop.run_callback_threadsafe`, which then fills per-request `gevent.queue.Queue`s
(docs/architecture.md, "Threading model"). Without gevent a plain `queue.SimpleQueue`
per request is enough.

The real-OS-thread, queue and lock primitives, which gevent patches away, are in
pipeserve/gevent_support.py.
"""

from __future__ import annotations

import queue
from typing import Any

from pipeserve.events import Event
from pipeserve.gevent_support import gevent_patched

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
