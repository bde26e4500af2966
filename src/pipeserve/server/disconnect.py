"""Notice a client that hung up before we write to it (queue wait, long prefill), and
one that stays connected but stopped reading what we write.

gunicorn's gevent worker only notices a disconnect when a write fails; a watcher
greenlet on the request socket notices it within a millisecond (docs/architecture.md,
"Threading model").
"""

from __future__ import annotations

import logging
import socket
import struct
from collections.abc import Callable, Iterator
from typing import Any

from pipeserve.gevent_support import gevent_patched

log = logging.getLogger("pipeserve.http")
# Send buffer of a streaming connection. Linux would otherwise grow it to tcp_wmem's
# maximum (4 MB here): a client that stops reading would then stall no write for the
# minutes that take to fill at SSE rates (kB/s). 64 KiB still carries MB/s at 50 ms RTT.
STREAM_SEND_BUFFER = 64 * 1024


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


class StalledWriteGuard:
    """The WSGI body of a stream: hangs up on a client that stops reading.

    gunicorn writes with a blocking `sendall` and no timeout, so a client that keeps
    its connection open but never reads would hold the request greenlet, its socket
    and (until max_tokens) its engine slot forever. Each chunk handed to the server
    arms a timer that is disarmed when the server asks for the next one (or closes the
    body); if one write takes longer than `timeout` seconds, the socket is shut down:
    the write fails with EPIPE, which gunicorn drops quietly, and it closes the body,
    which cancels the generation. Waiting for the engine is not writing: a slow model
    never trips it. The socket's send buffer is capped so that the kernel does not
    absorb minutes of output first.
    """

    def __init__(
        self, body: Iterator[bytes], sock: socket.socket | None, timeout: float | None
    ) -> None:
        self._body = body
        self._sock = sock if timeout and gevent_patched("socket") else None
        self._timeout = timeout or 0.0
        self._timer: Any = None  # one hub timer per response, restarted for every write
        if self._sock is not None:
            import gevent

            self._timer = gevent.get_hub().loop.timer(self._timeout)
            try:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SEND_BUFFER)
            except OSError:
                pass

    def __iter__(self) -> StalledWriteGuard:
        return self

    def __next__(self) -> bytes:
        self._disarm()
        try:
            return next(self._body)
        finally:
            self._arm()  # covers the write of this chunk, or the server's closing chunk

    def close(self) -> None:
        if self._timer is not None:
            self._timer.close()
            self._timer = None
        close = getattr(self._body, "close", None)
        if close is not None:
            close()

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.start(self._hang_up)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.stop()

    def _hang_up(self) -> None:
        log.warning(
            "client stopped reading its stream for %g s; closing the connection", self._timeout
        )
        # On the OS socket: gevent's own shutdown() would fail the blocked write with
        # EBADF, which gunicorn logs as an error; EPIPE it drops quietly. Linger 0 makes
        # its close() a reset, so the kernel does not keep the unread output either.
        raw: Any = getattr(self._sock, "_sock", self._sock)  # gevent's socket wraps the OS one
        try:
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            raw.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
