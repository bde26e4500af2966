"""Handing one job's result from the engine OS thread to the request waiting for it.

The same hop as engine/output/channel.py: the engine thread never touches a gevent object; it
schedules one callback on the waiting greenlet's hub, which puts the result in a gevent
queue. Without gevent a plain SimpleQueue."""

from __future__ import annotations

import queue
from typing import Any

from pipeserve.engine.embedding.jobs import EmbedResult
from pipeserve.gevent_support import gevent_patched

_HUB_POLL = 1.0


class Mailbox:
    def __init__(self) -> None:
        self.hub: Any = None
        if gevent_patched():
            import gevent
            import gevent.queue

            self.hub = gevent.get_hub()
            self._queue: Any = gevent.queue.Queue()
        else:
            self._queue = queue.SimpleQueue()

    def put(self, result: EmbedResult) -> None:
        """From the engine thread."""
        if self.hub is None:
            self._queue.put(result)
        else:
            self.hub.loop.run_callback_threadsafe(self._queue.put, result)

    def get(self, timeout: float) -> EmbedResult | None:
        """The result, or None after `timeout` seconds."""
        left = timeout
        while left > 0:
            # gevent raises LoopExit on a wait that nothing else keeps alive: poll.
            wait = min(left, _HUB_POLL) if self.hub is not None else left
            try:
                result: EmbedResult = self._queue.get(timeout=wait)
                return result
            except queue.Empty:
                left -= wait
        return None
