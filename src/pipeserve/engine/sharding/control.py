"""The control channel between rank 0 and each other rank: one TCP connection per rank.

It carries the batch log (lockstep.py) and the start-up handshake, never activations
(those go over mx.distributed). A rank waiting for the next step blocks in `recv` at no
CPU cost, and a rank that dies shows up as EOF at once. Frames are a 4-byte length and
a payload: JSON from a joining rank (never unpickled on rank 0), pickle from rank 0 to
ranks that connected to it with the group's secret token.

Under gevent the worker's `socket` and `time` are patched; the engine thread is a real
OS thread, so this module uses the unpatched originals.
"""

from __future__ import annotations

import json
import pickle
import struct
from typing import Any

from pipeserve.gevent_support import os_lock

_LENGTH = struct.Struct("!I")
MAX_FRAME = 1 << 30


class ChannelClosed(ConnectionError):
    """The other end of a control connection is gone."""


class Connection:
    """A framed, blocking connection: one reader; writers take turns (on rank 0 the
    engine thread's batch log and the watchdog's pings)."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self._send_lock = os_lock()

    def send_bytes(self, payload: bytes) -> None:
        try:
            with self._send_lock:
                self.sock.sendall(_LENGTH.pack(len(payload)) + payload)
        except OSError as exc:
            raise ChannelClosed(f"control channel: {exc}") from exc

    def recv_bytes(self, timeout: float | None = None) -> bytes:
        self.sock.settimeout(timeout)
        header = self._exactly(_LENGTH.size)
        (size,) = _LENGTH.unpack(header)
        if size > MAX_FRAME:
            raise ChannelClosed(f"control channel: frame of {size} bytes")
        return self._exactly(size)

    def _exactly(self, size: int) -> bytes:
        chunks, left = [], size
        while left:
            try:
                chunk = self.sock.recv(min(left, 1 << 20))
            except TimeoutError:
                raise
            except OSError as exc:
                raise ChannelClosed(f"control channel: {exc}") from exc
            if not chunk:
                raise ChannelClosed("control channel closed by the other rank")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def send_json(self, data: dict[str, Any]) -> None:
        self.send_bytes(json.dumps(data).encode())

    def recv_json(self, timeout: float | None = None) -> dict[str, Any]:
        data = json.loads(self.recv_bytes(timeout))
        if not isinstance(data, dict):
            raise ChannelClosed("control channel: not a JSON object")
        return data

    def send_obj(self, obj: Any) -> None:
        self.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def recv_obj(self) -> Any:
        return pickle.loads(self.recv_bytes())

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
