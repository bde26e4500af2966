"""/health and /v1/models answer "starting" while the model loads (issue 34).

gunicorn binds the port before its worker has imported the server and loaded the model;
every request sent meanwhile used to wait unanswered in the listen queue until the model
was loaded (a readiness probe saw a hang, not a 503). A real server is polled from its
first accepted connection (the master imported the server before it bound the port, so the
worker accepts at once): the first answers are 503 "starting" (in /v1/models' protocol shape, as
the openai SDK reads it), given while the model was still loading (its "loaded" log
line not yet written), then 200, and nothing else in between; a chat request sent
while it boots waits and is answered, as before.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.serverproc import REPO, free_port, pipeserve_command, server_log, stop

pytestmark = [pytest.mark.server, pytest.mark.mlx]

CONFIG = f"""
pipelines_dir: {REPO / "pipelines"}
server: {{workers: 1}}
models:
  - {{name: demo, source: "demo:qwen3", pipeline: qwen3}}
endpoints:
  - {{route: /v1/chat/completions, api: openai-chat}}
"""
LOADED = "model demo loaded in"
IMPORTED = "server modules imported in"  # the master's lines, before the bind
PRELOADED = "tokenizers preloaded for the workers"
LISTENING = "Listening at:"


def accepts(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_health_and_models_answer_starting_until_the_model_is_ready(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG)
    port = free_port()
    log_path = server_log(port)
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*pipeserve_command(), "serve", "--config", str(config),
                                 "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                cwd=REPO, env=os.environ.copy(), start_new_session=True)  # fmt: skip
    try:
        while not accepts(port):
            assert proc.poll() is None, log_path.read_text()[-3000:]
            time.sleep(0.02)
        first = httpx.get(f"{base}/health", timeout=60)
        loaded_before_first_answer = LOADED in log_path.read_text()
        sdk = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.InternalServerError) as listed:
            sdk.models.list()
        chat: list[object] = []
        waiting = threading.Thread(target=lambda: chat.append(sdk.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=3)))  # fmt: skip
        waiting.start()
        statuses = [(first.status_code, first.json()["status"])]
        while statuses[-1][0] != 200:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            answer = httpx.get(f"{base}/health", timeout=60)
            statuses.append((answer.status_code, answer.json()["status"]))
            time.sleep(0.05)
        waiting.join(timeout=120)
    finally:
        stop(proc)
    log_text = log_path.read_text()
    # The master imports the server before it binds, so the worker has nothing to import
    # before its first accept (the first answer came 0.1-0.2 s after the bind, not 1-2.5 s).
    assert -1 < log_text.find(IMPORTED) < log_text.find(LISTENING), log_text[-3000:]
    # ... and the model's tokenizer (its parse holds the GIL: the worker's hub froze)
    assert -1 < log_text.find(PRELOADED) < log_text.find(LISTENING), log_text[-3000:]
    assert statuses[0] == (503, "starting") and first.headers["retry-after"] == "1"
    assert not loaded_before_first_answer  # answered while the model was still loading
    # 503 "starting" until the model is ready, then 200: no other answer, no hang.
    assert set(statuses[:-1]) == {(503, "starting")} and statuses[-1] == (200, "ok")
    error = listed.value
    assert error.status_code == 503 and error.code == "starting"
    assert "starting" in error.message
    assert len(chat) == 1 and chat[0].choices[0].finish_reason == "length"  # type: ignore[attr-defined]
