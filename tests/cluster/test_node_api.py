"""`pipeserve node`'s HTTP API against what anyone on the LAN can send, without MLX:
a request signed with the token is required, malformed input is a 4xx, and an idle connection does not hold
one of the agent's threads forever. Real sockets on 127.0.0.1."""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeserve.cluster.auth import sign_request
from pipeserve.cluster.node import IDLE_TIMEOUT, NodeAgent, NodeHandler, NodeServer

TOKEN = "node-api-test-token-0123456789"


@pytest.fixture
def node(tmp_path: Path) -> Iterator[int]:
    agent = NodeAgent(TOKEN, "default", None, tmp_path)
    handler = type("Handler", (NodeHandler,), {"agent": agent})
    server = NodeServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


def exchange(port: int, request: bytes) -> tuple[int, dict[str, object]]:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def post(port: int, body: bytes, headers: str) -> tuple[int, dict[str, object]]:
    head = f"POST /v1/node/ranks HTTP/1.0\r\n{headers}\r\n".encode()
    return exchange(port, head + body)


def signed(body: bytes, port: int) -> str:
    headers, _ = sign_request(TOKEN, "POST", "/v1/node/ranks", body, target=f"127.0.0.1:{port}")
    return "".join(f"{k}: {v}\r\n" for k, v in headers.items())


def test_requests_need_the_token(node: int) -> None:
    assert exchange(node, b"GET /v1/node HTTP/1.0\r\n\r\n")[0] == 401
    wrong = b"GET /v1/node HTTP/1.0\r\nAuthorization: Bearer not-the-token-0123456\r\n\r\n"
    assert exchange(node, wrong)[0] == 401
    token_as_bearer = f"GET /v1/node HTTP/1.0\r\nAuthorization: Bearer {TOKEN}\r\n\r\n"
    assert exchange(node, token_as_bearer.encode())[0] == 401  # the token itself is no proof
    assert post(node, b'{"command": "id"}', "Content-Length: 17\r\n")[0] == 401


def test_malformed_assignments_are_refused(node: int) -> None:
    status, body = post(node, b"{}", signed(b"{}", node) + "Content-Length: two\r\n")
    assert status == 400 and "Content-Length" in str(body["error"])
    assert post(node, b"{}", signed(b"{}", node) + "Content-Length: -1\r\n")[0] == 400
    command = b'{"command": "id"}'
    status, body = post(node, command, signed(command, node) + "Content-Length: 17\r\n")
    assert status == 400 and "invalid assignment" in str(body["error"])


def test_an_idle_connection_is_dropped(node: int, monkeypatch: pytest.MonkeyPatch) -> None:
    assert NodeHandler.timeout == IDLE_TIMEOUT and 0 < IDLE_TIMEOUT <= 60
    monkeypatch.setattr(NodeHandler, "timeout", 0.5)  # shortened for the test
    with socket.create_connection(("127.0.0.1", node), timeout=30) as sock:
        sock.sendall(b"GET /v1/node HTTP/1.0\r\n")  # then nothing more
        assert sock.recv(65536) == b""  # closed by the agent, no answer


def test_a_peer_that_leaves_is_no_traceback(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    server = NodeServer(("127.0.0.1", 0), NodeHandler)
    bug = ValueError("a bug")
    try:
        for error in (BrokenPipeError(32, "Broken pipe"), bug):
            try:
                raise error
            except Exception:
                server.handle_error(None, ("192.0.2.7", 40000))
    finally:
        server.server_close()
    assert capsys.readouterr().err == ""
    failures = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.exc_info[1] for r in failures if r.exc_info] == [bug]
