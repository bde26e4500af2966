"""The cluster token is used, never sent: an impostor node never sees it and is never
placed, a real node answers signed requests only once each, and answers are checked.
Real sockets on 127.0.0.1; the impostor is a tiny HTTP server that answers like a node."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from pipeserve.cluster.auth import (
    SIGNATURE_HEADER,
    RequestVerifier,
    group_secret,
    response_signed,
    sign_request,
    sign_response,
)
from pipeserve.cluster.node import NodeAgent, NodeHandler, NodeServer
from pipeserve.cluster.planning import explain_lines
from pipeserve.cluster.wire import NodeUntrusted, call
from pipeserve.config.models import ShardingOptions
from pipeserve.engine.weights.demo.build import ensure_demo_model

TOKEN = "the-real-cluster-secret-123"
TB = 10**12


class Impostor(BaseHTTPRequestHandler):
    """Answers every request as a huge, willing node would, without knowing the token."""

    received: list[bytes]  # set on the subclass: every request, as sent
    protocol_version = "HTTP/1.0"

    def _record_and_answer(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        headers = "".join(f"{name}: {value}\r\n" for name, value in self.headers.items())
        self.received.append(f"{self.requestline}\r\n{headers}\r\n".encode() + body)
        report = {"cluster": "default", "hostname": "impostor", "ring_port": 1, "ranks": [],
                  "memory": {"found": TB, "found_kind": "RAM", "usable": TB, "override": False},
                  "device": "cpu", "device_name": "cpu", "backend": "cpu",
                  "versions": {"mlx": "any"}, "id": "job", "state": "running"}  # fmt: skip
        data = json.dumps(report).encode()
        self.send_response(200 if self.command == "GET" else 202)
        self.send_header("Content-Length", str(len(data)))
        self.send_header(SIGNATURE_HEADER, "0" * 64)
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_DELETE = _record_and_answer

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve(
    handler: type[BaseHTTPRequestHandler], kind: type[ThreadingHTTPServer] = ThreadingHTTPServer
) -> tuple[ThreadingHTTPServer, str]:
    server = kind(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def impostor() -> Iterator[tuple[str, list[bytes]]]:
    received: list[bytes] = []
    server, address = serve(type("Handler", (Impostor,), {"received": received}))
    yield address, received
    server.shutdown()
    server.server_close()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[str]:
    agent = NodeAgent(TOKEN, "default", None, tmp_path)
    server, address = serve(type("Handler", (NodeHandler,), {"agent": agent}), NodeServer)
    yield address
    server.shutdown()
    server.server_close()


def test_an_impostor_never_gets_the_token_and_is_never_placed(
    impostor: tuple[str, list[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    address, received = impostor
    monkeypatch.setenv("PIPESERVE_CLUSTER_TOKEN", TOKEN)
    sharding = ShardingOptions(strategy="pipeline", nodes=[address])
    lines = explain_lines(Path(ensure_demo_model("qwen3")), sharding)
    text = "\n".join(lines)
    assert "cannot place it now" in text and "no other machine" in text
    assert (
        f"node {address}: untrusted" in text and "not signed with PIPESERVE_CLUSTER_TOKEN" in text
    )
    assert received and all(b"GET /v1/node " in r for r in received)  # asked, nothing more
    sent = b"".join(received)
    assert TOKEN.encode() not in sent and TOKEN.encode().hex().encode() not in sent
    assert b"Pipeserve-HMAC ts=" in sent


def test_a_real_node_answers_signed_requests_and_its_answers_check(node: str) -> None:
    report = call(node, "GET", "/v1/node", TOKEN)
    assert report["cluster"] == "default" and report["memory"]["usable"] > 0
    with pytest.raises(NodeUntrusted, match="HTTP 401: wrong signature"):
        call(node, "GET", "/v1/node", "another-cluster-token-0123")


def raw_exchange(address: str, request: bytes) -> tuple[int, bytes, bytes]:
    host, port = address.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), head, body


def signed_get(path: str, now: float | None = None, target: str = "") -> tuple[bytes, str]:
    headers, nonce = sign_request(TOKEN, "GET", path, now=now, target=target)
    lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return f"GET {path} HTTP/1.0\r\n{lines}\r\n".encode(), nonce


def test_a_replayed_or_stale_request_is_refused(node: str) -> None:
    request, nonce = signed_get("/v1/node", target=node)
    status, head, body = raw_exchange(node, request)
    assert status == 200
    signature = next(line.split(b": ", 1)[1] for line in head.split(b"\r\n")
                     if line.lower().startswith(SIGNATURE_HEADER.lower().encode()))  # fmt: skip
    assert response_signed(TOKEN, nonce, 200, body, signature.decode(), node)
    status, head, body = raw_exchange(node, request)  # the same bytes again
    assert status == 401 and "replayed request refused" in json.loads(body)["error"]
    assert SIGNATURE_HEADER.lower().encode() not in head.lower()  # refusals are not signed
    stale, _ = signed_get("/v1/node", now=time.time() - 3600, target=node)
    status, _, body = raw_exchange(node, stale)
    assert status == 401 and "off this machine's clock" in json.loads(body)["error"]


def test_signatures_bind_every_part_and_the_group_secret_needs_the_token() -> None:
    verifier = RequestVerifier(TOKEN)
    headers, nonce = sign_request(TOKEN, "POST", "/v1/node/ranks", b"{}")
    auth = headers["Authorization"]
    assert verifier.check(auth, "POST", "/v1/node/ranks/x", b"{}")[0] is None  # other path
    assert verifier.check(auth, "POST", "/v1/node/ranks", b"{ }")[0] is None  # other body
    assert verifier.check(auth, "DELETE", "/v1/node/ranks", b"{}")[0] is None  # other method
    assert RequestVerifier("another-cluster-token-0123").check(
        auth, "POST", "/v1/node/ranks", b"{}"
    ) == (None, "wrong signature: PIPESERVE_CLUSTER_TOKEN differs between the machines")
    assert verifier.check(auth, "POST", "/v1/node/ranks", b"{}") == (nonce, None)
    answer = sign_response(TOKEN, nonce, 202, b"{}")[SIGNATURE_HEADER]
    assert response_signed(TOKEN, nonce, 202, b"{}", answer)
    assert not response_signed(TOKEN, "0" * 32, 202, b"{}", answer)  # another request's
    assert not response_signed(TOKEN, nonce, 200, b"{}", answer)
    assert group_secret(TOKEN, nonce) != group_secret("another-cluster-token-0123", nonce)
    assert TOKEN not in group_secret(TOKEN, nonce)
