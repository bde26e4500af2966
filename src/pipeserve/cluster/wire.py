"""HTTP between the serving machine and its nodes, on plain OS sockets.

Rank 0 talks to nodes from OS threads of a gevent worker, where the `socket` module is
patched; http.client on an unpatched socket keeps those calls off gevent's hubs. The
node process (no gevent) uses the same code.
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import time
from functools import cache
from typing import Any

from pipeserve.cluster.auth import (
    SIGNATURE_HEADER,
    TOKEN_ENV,
    endpoint,
    response_signed,
    sign_request,
)
from pipeserve.gevent_support import os_socket_class

DEFAULT_NODE_PORT = 7337
MAX_ANSWER = 1 << 20  # bytes of a node's answer read before its signature is checked


class NodeUnreachable(ConnectionError):
    """A node did not answer (down, cut off, or nothing listening there)."""


class NodeRefused(RuntimeError):
    """A node answered with an error (wrong token, bad assignment...)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class NodeUntrusted(NodeRefused):
    """An answer not signed with the cluster token: whatever it says is not used."""


def split_address(address: str, default_port: int = DEFAULT_NODE_PORT) -> tuple[str, int]:
    """'host', 'host:port' or '[v6]:port' -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or host.endswith(":") or (":" in host and not host.startswith("[")):
        return address.strip("[]"), default_port
    return host.strip("[]"), int(port)


def _resolve(host: str, port: int) -> tuple[Any, ...]:
    getaddrinfo = socket.getaddrinfo
    try:
        from gevent import monkey

        if monkey.is_module_patched("socket"):
            getaddrinfo = monkey.get_original("socket", "getaddrinfo")
    except ImportError:
        pass
    infos = getaddrinfo(host, port, 0, socket.SOCK_STREAM)
    if not infos:
        raise OSError(f"cannot resolve {host}")
    return tuple(infos[0])


@cache
def _deadline_socket() -> type[Any]:
    """An OS socket whose every read and write fits in one total deadline (`deadline`,
    monotonic): a peer sending a byte at a time cannot stretch a call past it."""
    base: type[Any] = os_socket_class()

    class DeadlineSocket(base):  # type: ignore[misc]
        deadline = math.inf
        stall = 30.0  # seconds one read or write may wait

        def _budget(self) -> None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no complete answer within the call's deadline")
            super().settimeout(min(left, self.stall))

        def recv_into(self, *args: Any) -> Any:
            self._budget()
            return super().recv_into(*args)

        def recv(self, *args: Any) -> Any:
            self._budget()
            return super().recv(*args)

        def sendall(self, *args: Any) -> Any:
            self._budget()
            return super().sendall(*args)

    return DeadlineSocket


class _Connection(http.client.HTTPConnection):
    """One connection whose whole exchange (connect, request, answer) ends by
    `self.timeout` seconds from its start."""

    def connect(self) -> None:
        deadline = time.monotonic() + (self.timeout or 30.0)
        family, kind, proto, _, where = _resolve(self.host, self.port)
        sock = _deadline_socket()(family, kind, proto)
        sock.deadline = deadline
        sock.stall = self.timeout or 30.0
        sock.settimeout(self.timeout)
        sock.connect(where)
        self.sock = sock

    def dialled(self) -> str:
        """endpoint() of the address this connection reached (connecting first)."""
        if self.sock is None:
            self.connect()
        return endpoint(self.sock.getpeername())


def call(
    address: str,
    method: str,
    path: str,
    token: str,
    body: dict[str, Any] | None = None,
    timeout: float = 5.0,
) -> dict[str, Any]:
    """One signed JSON request to a node; its answer once its signature is checked, else
    NodeUntrusted, NodeRefused (a signed error) or NodeUnreachable."""
    host, port = split_address(address)
    conn = _Connection(host, port, timeout=timeout)
    data = json.dumps(body).encode() if body is not None else b""
    try:
        dialled = conn.dialled()
        auth, nonce = sign_request(token, method, path, data, target=dialled)
        headers = {**auth, "Content-Type": "application/json", "Content-Length": str(len(data))}
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        raw = response.read(MAX_ANSWER + 1)
    except (OSError, http.client.HTTPException) as exc:
        raise NodeUnreachable(f"node {address}: {exc or type(exc).__name__}") from exc
    finally:
        conn.close()
    if len(raw) > MAX_ANSWER:
        message = f"node {address}: untrusted, an answer over {MAX_ANSWER} bytes"
        raise NodeUntrusted(response.status, message)
    signature = response.getheader(SIGNATURE_HEADER)
    if not response_signed(token, nonce, response.status, raw, signature, dialled):
        answer = _json(raw)
        said = f"HTTP {response.status}: {str(answer.get('error', response.reason))[:160]}"
        raise NodeUntrusted(
            response.status,
            f"node {address}: untrusted, its answer is not signed with {TOKEN_ENV} by the"
            f" node at {dialled} ({said})",
        )
    answer = _json(raw)
    if response.status >= 400:
        raise NodeRefused(
            response.status, f"node {address}: {answer.get('error', response.reason)}"
        )
    return answer


def _json(raw: bytes) -> dict[str, Any]:
    try:
        answer = json.loads(raw or b"{}")
    except ValueError:
        return {"error": raw[:200].decode(errors="replace")}
    return answer if isinstance(answer, dict) else {"value": answer}


def open_download(
    host: str, port: int, path: str, token: str, timeout: float = 30.0
) -> tuple[_Connection, http.client.HTTPResponse]:
    """A signed GET whose body the caller streams (model files, each checked by its sha256
    from the signed assignment); raises NodeRefused on 4xx/5xx. The headers must come
    within `timeout`; then each read may wait that long (a large file takes its time).
    Whatever the peer sends, the errors are NodeRefused or NodeUnreachable (an OSError)."""
    conn = _Connection(host, port, timeout=timeout)
    try:
        signed = sign_request(token, "GET", path, target=conn.dialled())[0]
        conn.request("GET", path, headers=signed)
        sock: Any = conn.sock  # the response reads it; the connection forgets it (HTTP/1.0)
        response = conn.getresponse()
        if response.status != 200:
            message = response.read(200)[:200].decode(errors="replace")
            conn.close()
            raise NodeRefused(response.status, f"{host}:{port}{path}: {response.status} {message}")
    except (OSError, http.client.HTTPException) as exc:
        conn.close()
        raise NodeUnreachable(f"{host}:{port}{path}: {exc or type(exc).__name__}") from exc
    sock.deadline = math.inf  # the headers came in time; each read now has `timeout`
    return conn, response
