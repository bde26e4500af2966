"""Notice a client that hung up before we write to it (queue wait, long prefill).

gunicorn's gevent worker only notices a disconnect when a write fails; a watcher
greenlet on the request socket notices it within a millisecond (DESIGN.md section 5).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from pipeserve.gevent_support import gevent_patched


def watch_disconnect(env: dict[str, Any], on_disconnect: Callable[[], None]) -> Callable[[], None]:
    """Start watching; returns a function that stops the watcher. No-op outside gevent."""
    sock = env.get("gunicorn.socket")
    if sock is None or not gevent_patched("socket"):
        return lambda: None
    import gevent

    greenlet = gevent.spawn(_watch, sock, on_disconnect)
    return lambda: greenlet.kill(block=False)


def _watch(sock: socket.socket, on_disconnect: Callable[[], None]) -> None:
    from gevent.socket import wait_read

    try:
        wait_read(sock.fileno())
        peeked = sock.recv(1, socket.MSG_PEEK)
    except (OSError, ValueError):
        peeked = b""
    if peeked == b"":
        on_disconnect()
    # Non-empty: the client pipelined its next request; it is still there. Stop watching.
