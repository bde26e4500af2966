"""HTTP between the serving machine and its nodes, on plain OS sockets.

Rank 0 talks to nodes from OS threads of a gevent worker, where the `socket` module is
patched; http.client on an unpatched socket keeps those calls off gevent's hubs. The
node process (no gevent) uses the same code.
"""

from __future__ import annotations

import http.client
import json
import socket
from typing import Any

from pipeserve.cluster.auth import SIGNATURE_HEADER, TOKEN_ENV, response_signed, sign_request
from pipeserve.gevent_support import os_socket_class

DEFAULT_NODE_PORT = 7337


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


class _Connection(http.client.HTTPConnection):
    def connect(self) -> None:
        family, kind, proto, _, where = _resolve(self.host, self.port)
        sock = os_socket_class()(family, kind, proto)
        sock.settimeout(self.timeout)
        sock.connect(where)
        self.sock = sock


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
    auth, nonce = sign_request(token, method, path, data)
    headers = {**auth, "Content-Type": "application/json", "Content-Length": str(len(data))}
    try:
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        raw = response.read()
    except OSError as exc:
        raise NodeUnreachable(f"node {address}: {exc}") from exc
    finally:
        conn.close()
    answer = _json(raw)
    if not response_signed(
        token, nonce, response.status, raw, response.getheader(SIGNATURE_HEADER)
    ):
        said = f"HTTP {response.status}: {str(answer.get('error', response.reason))[:160]}"
        raise NodeUntrusted(
            response.status,
            f"node {address}: untrusted, its answer is not signed with {TOKEN_ENV} ({said})",
        )
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
    from the signed assignment); raises NodeRefused on 4xx/5xx."""
    conn = _Connection(host, port, timeout=timeout)
    conn.request("GET", path, headers=sign_request(token, "GET", path)[0])
    response = conn.getresponse()
    if response.status != 200:
        message = response.read()[:200].decode(errors="replace")
        conn.close()
        raise NodeRefused(response.status, f"{host}:{port}{path}: {response.status} {message}")
    return conn, response
