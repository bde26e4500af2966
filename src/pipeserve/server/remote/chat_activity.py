"""Whether the engine host's chat models are decoding, for the workers' embedding engines.

With `server.workers > 1` the generation models run in the engine host while each worker
runs its own embedding engines, which give way to chat (engine/embedding/yielding.py).
An embedding engine asks between two batches, on its own OS thread, so the answer must
not need the worker's hub or a round trip: the host writes, every PUBLISH_SECONDS, the
number of sequences its engines decode and the time into a 16-byte file beside its
socket (in the master's private snapshot folder), and a worker reads it with one pread.
A record older than STALE_SECONDS (a host stopped or stalled) counts as no chat.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("pipeserve.serving")
RECORD = struct.Struct("<dq")  # (time.time() of the update, active sequences)
PUBLISH_SECONDS = 0.05
STALE_SECONDS = 1.0


def activity_path(socket_path: Path) -> Path:
    return socket_path.with_name(socket_path.name + ".chat")


class ChatActivityWriter:
    """The host's side: one file, rewritten in place."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.publish(0)

    def publish(self, active: int) -> None:
        os.pwrite(self._fd, RECORD.pack(time.time(), active), 0)

    def close(self) -> None:
        os.close(self._fd)


def publish_forever(
    writer: ChatActivityWriter, active: Callable[[], int], stopped: Callable[[], bool]
) -> None:
    """The host's loop (a greenlet): `active()` every PUBLISH_SECONDS until `stopped()`."""
    import gevent

    while not stopped():
        try:
            writer.publish(active())
        except Exception:  # never let a stats hiccup end the loop
            log.exception("engine host: could not publish the chat activity")
        gevent.sleep(PUBLISH_SECONDS)


class ChatActivityReader:
    """A worker's side; safe from any thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def chat_running(self) -> bool:
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY)
            data = os.pread(self._fd, RECORD.size, 0)
        except OSError:  # not written yet, or the host is gone
            return False
        if len(data) != RECORD.size:
            return False
        stamp, active = RECORD.unpack(data)
        return bool(active > 0 and time.time() - stamp < STALE_SECONDS)
