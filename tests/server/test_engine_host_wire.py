"""The engine host's wire, spoken directly: one frame per engine step per worker.

A real engine host process (as the master starts it) serves the qwen3 demo model; the
test is one "worker" connection that submits 8 greedy jobs at once and counts the
frames it gets back. Sent per token, that would be one frame per job per token; sent
per step, each frame carries the step's tokens of every job of this connection.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeserve.config import load_server_config
from pipeserve.engine.base import GenerationJob
from pipeserve.events import Finish, PromptReady, TokenText, Usage
from pipeserve.request import SamplingParams
from pipeserve.server.remote.wire import frames, model_key, send_frame
from tests.server.serverproc import REPO

pytestmark = [pytest.mark.server, pytest.mark.mlx]

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
    snapshot.write_bytes(pickle.dumps(loaded))
    command = [sys.executable, "-m", "pipeserve.server.remote.host", "--snapshot",
               str(snapshot), "--socket", str(path), "--parent", str(os.getpid())]  # fmt: skip
    proc = subprocess.Popen(command)
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


def test_one_frame_per_step_for_all_jobs_of_a_connection(host: tuple[Path, str]) -> None:
    path, key = host
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(path))
        for n in range(JOBS):
            send_frame(sock, ("submit", n, key, job(n), None))
        events: dict[int, list[object]] = {n: [] for n in range(JOBS)}
        accepted, count = set(), 0
        for message in frames(sock.makefile("rb")):
            kind, replies, batch = message
            assert kind == "batch"
            count += 1
            accepted |= {k for k, answer in replies if answer is None}
            for k, part in batch:
                events[k] += part
            if all(e and isinstance(e[-1], Usage) for e in events.values()):
                break
    assert accepted == set(range(JOBS))
    for stream in events.values():  # the engine's contract, intact across the socket
        assert isinstance(stream[0], PromptReady)
        assert isinstance(stream[-2], Finish) and stream[-2].reason == "length"
        assert sum(isinstance(e, TokenText) for e in stream) == TOKENS
    # Per token that would be JOBS x TOKENS frames; per step about TOKENS (+ admission).
    assert count <= TOKENS + JOBS, f"{count} frames for {JOBS} jobs of {TOKENS} tokens"
