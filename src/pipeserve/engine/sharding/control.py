"""The control channel between rank 0 and each other rank: one TCP connection per rank.

It carries the batch log (lockstep.py) and the start-up handshake, never activations
(those go over mx.distributed). A rank waiting for the next step blocks in `recv` at no
CPU cost, and a rank that dies shows up as EOF at once. Frames are a 4-byte length and
a payload in a fixed JSON schema (frames.py: never pickle), each read whole within a size
cap and, during the handshake, a total deadline; after the mutual challenge-response on
the group's token (frames.Handshake) every frame carries a MAC (frames.Session) checked
before it is parsed.

Under gevent the worker's `socket` and `time` are patched; the engine thread is a real
OS thread, so this module uses the unpatched originals.
"""

from __future__ import annotations

import json
import struct
import time
from typing import Any

from pipeserve.engine.sharding.frames import (
    ProtocolError,
    Session,
    decode_message,
    decode_object,
    encode_message,
)
from pipeserve.gevent_support import os_lock

_LENGTH = struct.Struct("!I")
MAX_FRAME = 256 << 20  # rank 0's frames to a rank (a step's batch log with its prompts)
REPORT_FRAME = 1 << 20  # a rank's frames to rank 0 (hello, its load report, an error)


class ChannelClosed(ConnectionError):
    """The other end of a control connection is gone."""


class Connection:
    """A framed, blocking connection: one reader; writers take turns (on rank 0 the
    engine thread's batch log and the watchdog's pings)."""

    def __init__(
        self,
        sock: Any,
        max_frame: int = MAX_FRAME,
        name: str = "control channel",
        send_lock: Any = None,
    ) -> None:
        self.sock = sock
        self.max_frame = max_frame  # larger frames are refused before they are read
        self.name = name  # in its errors (the engine host's wire reuses this class)
        self.session: Session | None = None  # set after the handshake: every frame MACed
        # Writers take turns: OS threads here; greenlets on the engine host's wire.
        self._send_lock = os_lock() if send_lock is None else send_lock

    def send_bytes(self, payload: bytes) -> None:
        try:
            with self._send_lock:  # sealed in the order the frames go out
                if self.session is not None:
                    payload = self.session.seal(payload)
                self.sock.sendall(_LENGTH.pack(len(payload)) + payload)
        except OSError as exc:
            raise ChannelClosed(f"{self.name}: {exc}") from exc

    def recv_bytes(self, timeout: float | None = None, limit: int | None = None) -> bytes:
        """The next frame, its MAC checked; `timeout` bounds the whole frame (not each
        read), `limit` its size (default max_frame). TimeoutError past the deadline."""
        deadline = None if timeout is None else time.monotonic() + timeout
        header = self._exactly(_LENGTH.size, deadline)
        (size,) = _LENGTH.unpack(header)
        if size > (self.max_frame if limit is None else limit):
            raise ChannelClosed(f"{self.name}: a frame of {size} bytes (too large)")
        frame = self._exactly(size, deadline)
        if self.session is None:
            return frame
        try:
            return self.session.open(frame)
        except ProtocolError as exc:
            raise ChannelClosed(f"{self.name}: {exc}") from None

    def _exactly(self, size: int, deadline: float | None) -> bytes:
        chunks, left = [], size
        while left:
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{self.name}: a frame was not sent in time")
                self.sock.settimeout(remaining)
            else:
                self.sock.settimeout(None)
            try:
                chunk = self.sock.recv(min(left, 1 << 20))
            except TimeoutError:
                raise
            except OSError as exc:
                raise ChannelClosed(f"{self.name}: {exc}") from exc
            if not chunk:
                raise ChannelClosed(f"{self.name} closed by the other end")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def send_json(self, data: dict[str, Any]) -> None:
        self.send_bytes(json.dumps(data).encode())

    def recv_json(self, timeout: float | None = None, limit: int | None = None) -> dict[str, Any]:
        try:
            return decode_object(self.recv_bytes(timeout, limit), f"{self.name} frame")
        except ProtocolError as exc:
            raise ChannelClosed(f"{self.name}: {exc}") from None

    def send_obj(self, message: tuple[Any, ...]) -> None:
        """One of rank 0's messages, in the fixed schema (frames.encode_message)."""
        self.send_bytes(encode_message(message))

    def recv_obj(self) -> tuple[Any, ...]:
        try:
            return decode_message(self.recv_bytes())
        except ProtocolError as exc:
            raise ChannelClosed(f"{self.name}: {exc}") from None

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
