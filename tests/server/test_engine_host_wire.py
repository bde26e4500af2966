"""The engine host's wire, spoken directly to a real engine host process (as the master
starts it, serving the qwen3 demo model).

One frame per engine step per worker: one "worker" connection submits 8 greedy jobs at
once and counts the frames it gets back. Sent per token, that would be one frame per job
per token; sent per step, each frame carries the step's tokens of every job of this
connection. Then the attacks (issue 34): the wire used to pickle.loads every frame, so
whatever reached the socket ran code in the host; now a pickle frame, a connection
without the server's secret and a frame without its MAC are refused, and the host keeps
serving its workers.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeserve.config import load_server_config
from pipeserve.engine.base import GenerationJob
from pipeserve.engine.sharding.control import ChannelClosed, Connection
from pipeserve.engine.sharding.frames import VERSION
from pipeserve.events import Finish, PromptReady, TokenText, Usage
from pipeserve.request import SamplingParams
from pipeserve.server.remote.wire import (
    decode_batch,
    encode_request,
    model_key,
    worker_handshake,
    write_sealed,
)
from pipeserve.wire_schema import ProtocolError
from tests.server.serverproc import REPO

pytestmark = [pytest.mark.server, pytest.mark.mlx]
SECRET = os.urandom(32).hex()
LENGTH = struct.Struct("!I")

JOBS = 8
TOKENS = 24


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    folder = tmp_path_factory.mktemp("host")
    folder.chmod(0o700)
    config = folder / "config.yaml"
    config.write_text(
        f"pipelines_dir: {REPO / 'pipelines'}\n"
        "models:\n  - {name: demo, source: 'demo:qwen3', pipeline: qwen3,"
        " options: {max_batch: 8, warmup: false}}\n"
        "endpoints:\n  - {route: /v1/chat/completions, api: openai-chat}\n"
    )
    loaded = load_server_config(config)
    snapshot, path = folder / "config.pickle", folder / "engines.sock"
    write_sealed(snapshot, loaded, SECRET)
    command = [sys.executable, "-m", "pipeserve.server.remote.host", "--snapshot",
               str(snapshot), "--socket", str(path), "--parent", str(os.getpid())]  # fmt: skip
    proc = subprocess.Popen(command, stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(f"{SECRET}\n".encode())
    proc.stdin.close()
    try:
        deadline = time.monotonic() + 240
        while not path.exists():
            assert proc.poll() is None, "the engine host exited"
            assert time.monotonic() < deadline, "the engine host did not start"
            time.sleep(0.1)
        yield path, model_key(loaded.config.models[0])
    finally:
        proc.send_signal(signal.SIGUSR1)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def job(n: int) -> GenerationJob:
    prompt = [151644, 872, 198, 1000 + n, 151645, 198, 151644, 77091, 198]
    return GenerationJob(f"req-{n}", prompt, SamplingParams(temperature=0.0), TOKENS)


def worker(path: Path, secret: str = SECRET) -> Connection:
    """A connection as a gunicorn worker makes it: connect, then the handshake."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(path))
    conn = Connection(sock, name="engine host wire")
    worker_handshake(conn, secret, wait=30)
    return conn


def run_jobs(
    conn: Connection, key: str, jobs: int
) -> tuple[set[int], dict[int, list[object]], int]:
    """Submit `jobs` jobs; (accepted keys, events by key, frames received)."""
    for n in range(jobs):
        conn.send_bytes(encode_request(("submit", n, key, job(n), None)))
    events: dict[int, list[object]] = {n: [] for n in range(jobs)}
    accepted, count = set(), 0
    while not all(e and isinstance(e[-1], Usage) for e in events.values()):
        kind, replies, batch = decode_batch(conn.recv_bytes(timeout=120))
        assert kind == "batch"
        count += 1
        accepted |= {k for k, answer in replies if answer is None}
        for k, part in batch:
            events[k] += part
    return accepted, events, count


def test_one_frame_per_step_for_all_jobs_of_a_connection(host: tuple[Path, str]) -> None:
    path, key = host
    conn = worker(path)
    try:
        accepted, events, count = run_jobs(conn, key, JOBS)
    finally:
        conn.close()
    assert accepted == set(range(JOBS))
    for stream in events.values():  # the engine's contract, intact across the socket
        assert isinstance(stream[0], PromptReady)
        assert isinstance(stream[-2], Finish) and stream[-2].reason == "length"
        assert sum(isinstance(e, TokenText) for e in stream) == TOKENS
    # Per token that would be JOBS x TOKENS frames; per step about TOKENS (+ admission).
    assert count <= TOKENS + JOBS, f"{count} frames for {JOBS} jobs of {TOKENS} tokens"


# ---------------------------------------------------------------- attacks


class Exploit:
    """What a pickle frame could do to the old host: run a command (touch a file)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (os.system, (f"touch {self.marker}",))


def still_serves(path: Path, key: str) -> None:
    conn = worker(path)
    try:
        accepted, events, _ = run_jobs(conn, key, 1)
    finally:
        conn.close()
    assert accepted == {0} and isinstance(events[0][0], PromptReady)


def test_a_pickle_frame_never_runs_code_in_the_host(host: tuple[Path, str], tmp_path: Path) -> None:
    """The frame that ran `touch` in the old host (it unpickled every frame from the
    socket): sent first, it is not a hello; sent after a genuine handshake, its MAC is
    wrong. Either way the connection ends, the command never ran, the host serves on."""
    path, key = host
    marker = tmp_path / "pwned"
    payload = pickle.dumps(("submit", 1, key, Exploit(marker), None))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(path))
        sock.sendall(LENGTH.pack(len(payload)) + payload)
        sock.settimeout(30)
        assert sock.recv(1) == b""  # closed by the host, nothing answered
    conn = worker(path)
    conn.sock.sendall(LENGTH.pack(len(payload)) + payload)  # no MAC: not from a worker
    with pytest.raises(ChannelClosed):
        conn.recv_bytes(timeout=30)
    conn.close()
    assert not marker.exists()
    still_serves(path, key)


def test_a_process_without_the_secret_gets_no_proof_and_no_service(
    host: tuple[Path, str],
) -> None:
    """A process that reaches the socket without the server's secret fails the handshake
    (the host's proof does not verify for it, its own proof does not verify for the host),
    and a submit it sends anyway is never run: the connection ends, nothing answered."""
    path, key = host
    with pytest.raises(ProtocolError, match="did not prove"):
        worker(path, secret="00" * 32)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(path))
    conn = Connection(sock)
    conn.send_json({"v": VERSION, "rank": 1, "pid": 1, "nonce": "ab" * 16})
    challenge = conn.recv_json(timeout=30)
    assert set(challenge) == {"v", "nonce", "proof"}  # the proof is an HMAC, not the secret
    assert SECRET not in json.dumps(challenge)
    conn.send_json({"proof": "cd" * 32})
    with pytest.raises(ChannelClosed):  # the host may close before the submit is even sent
        conn.send_bytes(encode_request(("submit", 1, key, job(1), None)))
        conn.recv_bytes(timeout=30)
    conn.close()
    still_serves(path, key)


def test_oversized_and_malformed_hellos_are_refused_unread(host: tuple[Path, str]) -> None:
    """A hello announced as 1 GiB is refused before it is read, a non-JSON hello and one
    of wrong types end the connection; the host keeps serving."""
    path, key = host
    typed_wrong = json.dumps({"v": VERSION, "rank": "x", "pid": 1, "nonce": "ab" * 16}).encode()
    for frame in (LENGTH.pack(1 << 30) + b"x" * 1024, LENGTH.pack(3) + b"\xff\x00{",
                  LENGTH.pack(len(typed_wrong)) + typed_wrong):  # fmt: skip
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(path))
            sock.sendall(frame)
            sock.settimeout(30)
            try:
                assert sock.recv(1) == b""
            except ConnectionResetError:  # closed with our bytes unread
                pass
    still_serves(path, key)
