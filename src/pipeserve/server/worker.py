"""gunicorn's gevent worker, letting idle keep-alive connections go at shutdown.

gunicorn's graceful stop waits for every connection handler to return, and a handler
sits in its keep-alive loop for up to 75 s after a response (SDK clients keep pooled
connections open). A stop or restart then took the whole graceful_timeout. Here, once
the worker is told to stop, connections between requests are shut down (their
handler ends as if the client had left), while requests in progress finish normally
(gunicorn closes those connections after their response).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import warnings
from typing import Any

import gevent
from gunicorn.arbiter import Arbiter
from gunicorn.workers.ggevent import GeventWorker

SHUTDOWN_POLL_SECONDS = 0.2


class PipeserveWorker(GeventWorker):  # type: ignore[misc]
    def init_process(self) -> None:
        self._connections: dict[int, socket.socket] = {}
        self._busy: set[int] = set()
        # The master imported the server before forking (serving.import_the_server), ssl
        # with it, so gevent warns that ssl is patched late. A worker opens no TLS
        # connection with Python's ssl (sources are fetched by the master; PostgreSQL's
        # TLS is libpq's own), so the late patch changes nothing a worker uses.
        warnings.filterwarnings("ignore", message="Monkey-patching ssl after ssl")
        super().init_process()

    def init_signals(self) -> None:
        super().init_signals()
        # gunicorn resets HUP to its default (terminate) in workers; here it means "the
        # master validated a new config: apply it" (pipeserve.reload).
        signal.signal(signal.SIGHUP, self.handle_hup)

    def handle_hup(self, sig: int, frame: Any) -> None:
        if getattr(self, "wsgi", None) is None:  # still booting: reload once booted
            self._reload_pending = True
            return
        reload = getattr(self.app, "reload_worker", None)  # PipeserveApplication's
        if reload is not None:
            gevent.spawn(reload, self.wsgi, self.log)  # not inside the signal handler

    def run(self) -> None:
        gevent.spawn(self._release_idle_at_shutdown)
        if getattr(self.wsgi, "boot", None) is not None:  # server/booting.py
            gevent.spawn(self._boot)
        if getattr(self, "_reload_pending", False):  # a SIGHUP came while models loaded
            self.handle_hup(signal.SIGHUP, None)
        super().run()

    def _boot(self) -> None:
        """Build the real app while this worker already answers /health "starting"; a
        failure ends the worker as a failed boot did (the master then stops)."""
        try:
            self.wsgi.boot()
        except BaseException:
            self.log.exception("Exception in worker process while loading the app")
            logging.shutdown()
            os._exit(Arbiter.WORKER_BOOT_ERROR)

    def handle(self, listener: Any, client: socket.socket, addr: Any) -> None:
        self._connections[id(client)] = client
        try:
            super().handle(listener, client, addr)
        finally:
            self._connections.pop(id(client), None)

    def handle_request(self, listener_name: Any, req: Any, sock: socket.socket, addr: Any) -> Any:
        self._busy.add(id(sock))
        try:
            return super().handle_request(listener_name, req, sock, addr)
        finally:
            self._busy.discard(id(sock))

    def _release_idle_at_shutdown(self) -> None:
        while self.alive:
            gevent.sleep(SHUTDOWN_POLL_SECONDS)
        while self._connections:  # new ones may still finish their handshake
            for key, sock in list(self._connections.items()):
                if key not in self._busy:
                    _shut(sock)
            gevent.sleep(SHUTDOWN_POLL_SECONDS)


def _shut(sock: socket.socket) -> None:
    """Shut the connection down under gevent's feet: the handler's pending read then
    returns EOF (the client left). gevent's own shutdown() would instead cancel that read
    with EBADF, which gunicorn logs as a "Socket error processing request" traceback."""
    raw = getattr(sock, "_sock", sock)  # gevent's socket wraps the OS one
    try:
        raw.shutdown(socket.SHUT_RDWR)
    except OSError:  # already gone
        pass
