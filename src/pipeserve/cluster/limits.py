"""Bounds on the connections anyone on the LAN can open before proving anything.

The node API and the model file server accept connections from any address (the token
is checked per request, after the request is read). `ConnectionLimits` keeps what such
connections can hold bounded: at most `per_address` at once from one address (more are
closed unread), at most `total` in all (a new one ends the oldest: a genuine request
finishes within a round trip, so a flood of silent connections cannot keep it out), and
each connection at most `deadline` seconds in all, however slowly its bytes arrive (a
reaper thread shuts it down then, which ends the read its handler is blocked in).
"""

from __future__ import annotations

import socket
import time
from collections import OrderedDict
from typing import Any

from pipeserve.gevent_support import os_lock, os_sleep, start_os_thread

REAP_EVERY = 0.25


class ConnectionLimits:
    def __init__(self, total: int, per_address: int, deadline: float) -> None:
        self.total = total
        self.per_address = per_address
        self.deadline = deadline
        self._open: OrderedDict[Any, tuple[str, float]] = OrderedDict()  # sock -> (ip, ends)
        self._lock = os_lock()  # real OS threads use it, also in a gevent worker
        self._reaping = False

    def admit(self, sock: Any, ip: str) -> bool:
        """Whether `sock` (from `ip`) may be served; False: the caller closes it."""
        with self._lock:
            if sum(1 for owner, _ in self._open.values() if owner == ip) >= self.per_address:
                return False
            oldest = None
            if len(self._open) >= self.total:
                oldest, _ = self._open.popitem(last=False)
            self._open[sock] = (ip, time.monotonic() + self.deadline)
            start = not self._reaping
            self._reaping = True
        if start:
            start_os_thread(self._reap, name="pipeserve-connection-limits")
        if oldest is not None:
            shut(oldest)
        return True

    def release(self, sock: Any) -> None:
        with self._lock:
            self._open.pop(sock, None)

    def count(self) -> int:
        with self._lock:
            return len(self._open)

    def _reap(self) -> None:
        """Shut connections past their deadline; ends when none is open (admit restarts it)."""
        while True:
            os_sleep(REAP_EVERY)
            now = time.monotonic()
            with self._lock:
                late = [s for s, (_, ends) in self._open.items() if ends <= now]
                for sock in late:
                    del self._open[sock]
                done = not self._open
                if done:
                    self._reaping = False
            for sock in late:
                shut(sock)
            if done:
                return


def shut(sock: Any) -> None:
    """End a connection another thread may be reading (its read returns at once)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


__all__ = ["ConnectionLimits", "shut"]
