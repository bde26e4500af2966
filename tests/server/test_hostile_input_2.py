"""A second adversarial pass with raw sockets against a real server: broken framing,
connection reuse after errors, pipelining, compressed bodies, clients that stall or
vanish in crowds. Every case ends in a 4xx in the route's protocol shape or a clean
close, never a 500 or a hang, and the server keeps serving. No timed asserts: socket
timeouts only catch real hangs."""

from __future__ import annotations

import gzip
import json
import re
import socket
import time
import zlib
from collections.abc import Iterator

import httpx
import pytest

from tests.server.serverproc import REPO, running_server

pytestmark = pytest.mark.server

CONFIG = f"""
server: {{body_read_timeout: 1}}
pipelines_dir: {REPO / "pipelines"}
models:
  - name: fast
    source: demo:qwen3
    pipeline: qwen3
    engine: replay
    replay: {{completion: "<think>\\n</think>\\n\\nhello"}}
  - name: slow
    source: demo:qwen3
    pipeline: qwen3
    engine: replay
    options: {{max_batch: 2, queue_size: 2}}
    replay: {{completion: "<think>\\n</think>\\n\\nhello", delay: 0.02}}
  - name: wide
    source: demo:qwen3
    pipeline: qwen3
    engine: replay
    options: {{max_batch: 64, queue_size: 8}}
    replay: {{completion: "<think>\\n</think>\\n\\nhello", delay: 0.02}}
endpoints:
  - {{route: /v1/chat/completions, api: openai-chat}}
  - {{route: /v1/messages, api: anthropic-messages}}
"""
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
ANSWER = "<think>\n</think>\n\nok"
LONG = "<think>\n</think>\n\n" + "word " * 3000
JSON = {"Content-Type": "application/json"}


def body_for(route: str, model: str = "fast", **extra: object) -> dict[str, object]:
    body: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "mock_response": ANSWER,
    }
    if route == MESSAGES:
        body["max_tokens"] = 4000
    return {**body, **extra}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("cfg") / "hostile.yaml"
    path.write_text(CONFIG)
    with running_server(path) as base:
        yield base


# -- raw HTTP/1.1 on a socket ---------------------------------------------------------


def connect(base: str, rcvbuf: int | None = None) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(60)  # only a real hang trips this
    sock.connect((host, int(port)))
    return sock


def request(
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    version: str = "1.1",
) -> bytes:
    fields = {"Host": "pipeserve.test", **(headers or {})}
    if body is not None and "Content-Length" not in fields and "Transfer-Encoding" not in fields:
        fields["Content-Length"] = str(len(body))
    head = (
        f"{method} {path} HTTP/{version}\r\n"
        + "".join(f"{k}: {v}\r\n" for k, v in fields.items())
        + "\r\n"
    )
    return head.encode("latin-1") + (body or b"")


def post(path: str, body: object, headers: dict[str, str] | None = None) -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return request("POST", path, data, {**JSON, **(headers or {})})


class Reader:
    """Reads HTTP/1.1 responses (Content-Length, chunked or until close) off a socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        self.buf += data
        return bool(data)

    def _until(self, marker: bytes) -> bytes | None:
        while marker not in self.buf:
            if not self._fill():
                return None
        head, _, self.buf = self.buf.partition(marker)
        return head

    def _exactly(self, size: int) -> bytes:
        while len(self.buf) < size and self._fill():
            pass
        out, self.buf = self.buf[:size], self.buf[size:]
        return out

    def response(self) -> tuple[int, dict[str, str], bytes] | None:
        """The next response, or None when the server closed the connection instead."""
        head = self._until(b"\r\n\r\n")
        if head is None:
            return None
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {
            k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)
        }
        status = int(status_line.split()[1])
        if status < 200:
            return status, headers, b""
        if "content-length" in headers:
            return status, headers, self._exactly(int(headers["content-length"]))
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while (size_line := self._until(b"\r\n")) and (size := int(size_line, 16)):
                body += self._exactly(size)
                self._exactly(2)
            self._until(b"\r\n")
            return status, headers, body
        while self._fill():
            pass
        body, self.buf = self.buf, b""
        return status, headers, body

    def closed(self) -> bool:
        """True when the server closes the connection (after any bytes still in flight)."""
        try:
            while self._fill():
                pass
        except ConnectionResetError:
            pass
        return True


def exchange(base: str, data: bytes, half_close: bool = False) -> tuple[int, dict[str, str], bytes]:
    with connect(base) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        reply = Reader(sock).response()
    assert reply is not None, "server closed the connection without a response"
    return reply


def assert_protocol_error(
    route: str, reply: tuple[int, dict[str, str], bytes], status: int, words: str = ""
) -> None:
    code, _, body = reply
    assert code == status, body
    payload = json.loads(body)
    if route == MESSAGES:
        assert payload["type"] == "error" and set(payload["error"]) >= {"type", "message"}
    else:
        assert set(payload["error"]) >= {"message", "type", "param", "code"}
    assert words.lower() in payload["error"]["message"].lower(), payload


def assert_serving(base: str) -> None:
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200
    reply = httpx.post(f"{base}{CHAT}", json=body_for(CHAT), timeout=30)
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "ok"


def metric(base: str, name: str, model: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    match = re.search(rf'^{name}\{{model="{model}"\}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def wait_idle(base: str, model: str) -> float:
    """Active sequences of `model` once they drain (or the last value after 30 s)."""
    deadline = time.monotonic() + 30
    while (
        active := metric(base, "pipeserve_active_sequences", model)
    ) > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    return active


# -- framing of the request body -------------------------------------------------------

BAD_CHUNKED = [
    pytest.param(b"zz\r\n{}\r\n0\r\n\r\n", "invalid chunk size", id="non-hex-size"),
    pytest.param(b"-5\r\n{}\r\n0\r\n\r\n", "invalid chunk size", id="negative-size"),
    pytest.param(b"2\r\n{}XX0\r\n\r\n", "terminator", id="missing-crlf"),
]


@pytest.mark.parametrize("route", [CHAT, MESSAGES])
@pytest.mark.parametrize(("chunked", "words"), BAD_CHUNKED)
def test_malformed_chunked_body_is_a_400_in_protocol_shape(
    server: str, route: str, chunked: bytes, words: str
) -> None:
    reply = exchange(
        server, request("POST", route, chunked, {**JSON, "Transfer-Encoding": "chunked"})
    )
    assert_protocol_error(route, reply, 400, words)  # was a 500 "internal error: InvalidChunkSize"


@pytest.mark.parametrize("route", [CHAT, MESSAGES])
def test_body_cut_short_then_half_closed_is_a_400(server: str, route: str) -> None:
    cut = request(
        "POST",
        route,
        b"40\r\n" + json.dumps(body_for(route)).encode()[:20],
        {**JSON, "Transfer-Encoding": "chunked"},
    )
    assert_protocol_error(
        route, exchange(server, cut, half_close=True), 400, "before the whole request body"
    )


def test_connection_closes_promptly_after_a_408(server: str) -> None:
    """gunicorn used to wait out its 75 s keep-alive draining a body that never came."""
    with connect(server) as sock:
        sock.sendall(request("POST", CHAT, None, {**JSON, "Content-Length": "500"}) + b'{"model"')
        reader = Reader(sock)
        reply = reader.response()
        assert reply is not None and reply[0] == 408
        sock.settimeout(30)  # far below the 75 s keep-alive: a timeout here is the old hang
        assert reader.closed()
    assert_serving(server)


@pytest.mark.parametrize("route", [CHAT, MESSAGES])
@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b'{"model": "fast", "max_tokens": ' + b"9" * 5000 + b"}", id="5000-digit-int"),
        pytest.param(b'{"model": "fast", "max_tokens": 5, "temperature": NaN}', id="NaN"),
        pytest.param(b'{"model": "fast", "max_tokens": Infinity}', id="Infinity"),
    ],
)
def test_numbers_python_parses_but_json_does_not_have(server: str, route: str, raw: bytes) -> None:
    assert_protocol_error(route, exchange(server, post(route, raw)), 400, "not valid JSON")


# -- Content-Encoding --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("coding", "compress"), [("gzip", gzip.compress), ("deflate", zlib.compress)]
)
def test_compressed_request_bodies_are_inflated(server: str, coding: str, compress: object) -> None:
    data = compress(json.dumps(body_for(MESSAGES)).encode())  # type: ignore[operator]
    code, _, body = exchange(server, post(MESSAGES, data, {"Content-Encoding": coding}))
    assert code == 200, body  # was a 400 "not valid UTF-8"
    assert json.loads(body)["content"][0]["text"] == "ok"


def test_unknown_encoding_and_gzip_bomb_are_refused(server: str) -> None:
    plain = json.dumps(body_for(CHAT)).encode()
    assert_protocol_error(
        CHAT, exchange(server, post(CHAT, plain, {"Content-Encoding": "br"})), 400, "not supported"
    )
    bomb = gzip.compress(
        b'{"pad": "' + b"a" * (20 * 1024 * 1024) + b'"}'
    )  # 20 KB inflating to 20 MB
    assert_protocol_error(
        MESSAGES,
        exchange(server, post(MESSAGES, bomb, {"Content-Encoding": "gzip"})),
        413,
        "inflates",
    )
    assert_protocol_error(
        CHAT, exchange(server, post(CHAT, b"not gzip", {"Content-Encoding": "gzip"})), 400, "gzip"
    )


# -- connection reuse, pipelining, Expect, HTTP/1.0, header limits ------------------------


def test_keep_alive_connection_survives_error_responses(server: str) -> None:
    with connect(server) as sock:
        reader = Reader(sock)
        steps = [
            (post(CHAT, b"{broken"), 400),
            (request("GET", "/no/such/route"), 404),
            (post(MESSAGES, {**body_for(MESSAGES), "model": "nope"}), 404),
            (post(CHAT, {**body_for(CHAT), "max_tokens": "8"}), 400),
        ]
        for data, status in steps:
            sock.sendall(data)
            reply = reader.response()
            assert reply is not None and reply[0] == status, reply
        sock.sendall(post(CHAT, body_for(CHAT)))
        reply = reader.response()
        assert (
            reply is not None
            and reply[0] == 200
            and json.loads(reply[2])["choices"][0]["message"]["content"] == "ok"
        )


def test_pipelined_requests_are_answered_in_order(server: str) -> None:
    stream = body_for(CHAT, model="slow", stream=True)
    with connect(server) as sock:
        sock.sendall(
            post(CHAT, body_for(CHAT))
            + post(CHAT, stream)
            + post(MESSAGES, body_for(MESSAGES))
            + request("GET", "/health")
        )
        reader = Reader(sock)
        replies = [reader.response() for _ in range(4)]
    assert [r[0] if r else None for r in replies] == [200, 200, 200, 200]
    assert replies[1] is not None and replies[1][2].rstrip().endswith(b"data: [DONE]")
    assert replies[2] is not None and json.loads(replies[2][2])["type"] == "message"
    assert replies[3] is not None and json.loads(replies[3][2])["status"] == "ok"


def test_expect_100_continue_and_http_1_0(server: str) -> None:
    data = json.dumps(body_for(CHAT)).encode()
    with connect(server) as sock:
        sock.sendall(
            request(
                "POST",
                CHAT,
                None,
                {**JSON, "Content-Length": str(len(data)), "Expect": "100-continue"},
            )
        )
        reader = Reader(sock)
        interim = reader.response()
        assert interim is not None and interim[0] == 100
        sock.sendall(data)
        final = reader.response()
        assert final is not None and final[0] == 200
    code, headers, body = exchange(
        server,
        request(
            "POST",
            MESSAGES,
            json.dumps(body_for(MESSAGES, stream=True)).encode(),
            JSON,
            version="1.0",
        ),
    )
    assert code == 200 and b"event: message_stop" in body  # no chunked framing: ends with the close


def test_header_floods_are_refused_without_stalling_the_server(server: str) -> None:
    """At 100 fields of 64 KB, gunicorn's parser spent 6.6 s of the hub per flood."""
    many = {f"X-Field-{i}": "v" for i in range(100)}
    assert exchange(server, post(CHAT, body_for(CHAT), many))[0] == 431
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        try:
            for i in range(70):  # 560 KB, past the 64 x 8 KB the server buffers for a head
                sock.sendall(b"X-Flood-%d: %s\r\n" % (i, b"a" * 8000))
        except OSError:
            pass  # the server may reset once it has refused the head
        try:
            reply = Reader(sock).response()
        except ConnectionResetError:
            reply = None
        assert reply is None or reply[0] == 431
    assert_serving(server)


def test_lone_surrogate_in_the_mock_header_and_huge_model_names(server: str) -> None:
    code, _, body = exchange(
        server,
        post(CHAT, {**body_for(CHAT), "mock_response": None}, {"X-Mock-Response": '"a\\ud800b"'}),
    )
    assert code == 200, body  # was a 500 (TypeError in the tokenizer)
    assert json.loads(body)["choices"][0]["message"]["content"] == "a\ufffdb"
    reply = exchange(server, post(MESSAGES, {**body_for(MESSAGES), "model": "m" * 100_000}))
    assert_protocol_error(MESSAGES, reply, 404, "not found")
    assert len(reply[2]) < 1000


# -- clients that vanish, half-close or stop reading -------------------------------------


@pytest.mark.parametrize("route", [CHAT, MESSAGES])
def test_half_close_before_the_answer_is_a_4xx_not_a_500(server: str, route: str) -> None:
    """EOF on the request socket counts as "client gone" (it cancels queue waits and long
    prefills); a client that only half-closed still reads a clear 4xx, not a 500."""
    body = body_for(route, model="slow", mock_response=LONG)
    assert_protocol_error(
        route, exchange(server, post(route, body), half_close=True), 400, "closed its side"
    )
    assert wait_idle(server, "slow") == 0


def test_a_client_that_stops_reading_is_hung_up_on_and_frees_its_slot(server: str) -> None:
    body = body_for(
        CHAT, model="slow", stream=True, mock_response="<think>\n</think>\n\n" + "word " * 20_000
    )
    with connect(server, rcvbuf=4096) as sock:
        sock.sendall(post(CHAT, body))
        assert sock.recv(1024).startswith(b"HTTP/1.1 200")
        # Read nothing more: once the small send buffer is full, one write blocks for
        # server.body_read_timeout (1 s here) and the server resets the connection.
        deadline = time.monotonic() + 60
        while (
            metric(server, "pipeserve_active_sequences", "slow") > 0 and time.monotonic() < deadline
        ):
            time.sleep(0.5)
        assert metric(server, "pipeserve_active_sequences", "slow") == 0  # 20000 tokens take 400 s
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
        assert b"[DONE]" not in received
    assert_serving(server)


def test_fifty_clients_vanishing_mid_stream_free_every_slot(server: str) -> None:
    socks = []
    for i in range(50):
        route = MESSAGES if i % 2 else CHAT
        sock = connect(server)
        sock.sendall(post(route, body_for(route, model="wide", stream=True, mock_response=LONG)))
        socks.append(sock)
    for sock in socks:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    assert metric(server, "pipeserve_active_sequences", "wide") == 50
    for i, sock in enumerate(socks):
        if i % 2:  # half of them reset, half close normally
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
        sock.close()
    assert wait_idle(server, "wide") == 0
    assert_serving(server)


def test_cancel_storm_while_the_queue_is_full(server: str) -> None:
    """`slow` takes 2 + 2 requests: the rest get 429 / 529 at once; when everybody
    leaves together the model is free again."""
    holders = []
    for _ in range(4):
        sock = connect(server)
        sock.sendall(post(CHAT, body_for(CHAT, model="slow", stream=True, mock_response=LONG)))
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        holders.append(sock)
    refused = [
        exchange(server, post(route, body_for(route, model="slow")))
        for route in (CHAT, MESSAGES) * 5
    ]
    assert {reply[0] for reply in refused} == {429, 529}
    for reply, route in zip(refused, (CHAT, MESSAGES) * 5):
        assert_protocol_error(route, reply, reply[0])
    for _ in range(20):  # a burst of clients that send a request and leave at once
        with connect(server) as sock:
            sock.sendall(post(CHAT, body_for(CHAT, model="slow", stream=True, mock_response=LONG)))
    for sock in holders:
        sock.close()
    assert wait_idle(server, "slow") == 0
    code, _, body = exchange(server, post(MESSAGES, body_for(MESSAGES, model="slow")))
    assert code == 200 and json.loads(body)["content"][0]["text"] == "ok"


def tcp_state(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]  # struct tcp_info.tcpi_state


def test_a_large_json_answer_to_a_client_that_never_reads_is_reset(server: str) -> None:
    # About 300 KB of JSON: more than the capped send buffer plus a 4 KB receive window.
    body = {
        **body_for(CHAT),
        "max_tokens": 30_000,
        "mock_response": "<think>\n</think>\n\n" + "internationalization " * 20_000,
    }
    with connect(server, rcvbuf=4096) as sock:
        sock.sendall(post(CHAT, body))
        deadline = time.monotonic() + 60
        while (
            tcp_state(sock) != 7 and time.monotonic() < deadline
        ):  # 7: TCP_CLOSE, the server reset it
            time.sleep(0.2)
        assert tcp_state(sock) == 7  # before: the server's write blocked forever
    assert_serving(server)
