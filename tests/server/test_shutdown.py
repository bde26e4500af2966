"""Stopping the server: a stream in progress finishes, idle keep-alive connections
(SDK connection pools) do not hold the stop for the whole graceful timeout."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.serverproc import REPO, server_process

pytestmark = pytest.mark.server

# graceful_timeout 60: a stop that waited for idle keep-alive connections would take it.
CONFIG = f"""
server: {{graceful_timeout: 60, workers: WORKERS}}
pipelines_dir: {REPO / "pipelines"}
models:
  - name: slow
    source: demo:qwen3
    pipeline: qwen3
    engine: replay
    replay: {{completion: "<think>\\n</think>\\n\\none two three four five six", delay: 0.15}}
endpoints:
  - {{route: /v1/chat/completions, api: openai-chat}}
"""
BODY = {"model": "slow", "messages": [{"role": "user", "content": "hi"}]}


# workers 2: the model runs in the engine host, which ignores the process group's SIGTERM
# so that the draining workers keep their engine, and stops after them.
@pytest.mark.parametrize("workers", [1, 2])
def test_stop_finishes_streams_and_releases_idle_keepalive(tmp_path: Path, workers: int) -> None:
    config = tmp_path / "slow.yaml"
    config.write_text(CONFIG.replace("WORKERS", str(workers)))
    with server_process(config) as (base, proc), httpx.Client(base_url=base, timeout=30) as pooled:
        children = descendants(proc.pid)
        assert (
            pooled.post("/v1/chat/completions", json=BODY).status_code == 200
        )  # now idle in the pool
        streamed: list[str] = []
        reader = threading.Thread(target=_stream_into, args=(base, streamed))
        reader.start()
        _wait_for(lambda: len(streamed) >= 2)
        os.killpg(proc.pid, signal.SIGTERM)
        reader.join(timeout=30)
        # The pooled client still holds its idle keep-alive connection open here: the
        # server must exit anyway (a hang guard, not a timing bound).
        proc.wait(timeout=60)
        assert pooled.is_closed is False
    assert "".join(streamed).endswith("[DONE]"), streamed
    assert "one two three four five six" in "".join(streamed)
    _wait_for(lambda: not [pid for pid in children if Path(f"/proc/{pid}").exists()])


def descendants(root: int) -> list[int]:
    """The server's processes below the master (workers, engine host), by parent pid."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return [pid for pid, parent in parents.items() if parent == root]


def _stream_into(base: str, out: list[str]) -> None:
    with httpx.stream(
        "POST", f"{base}/v1/chat/completions", json={**BODY, "stream": True}, timeout=30
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:] if line == "data: [DONE]" else _content(line))


def _content(line: str) -> str:
    import json

    choices = json.loads(line[6:]).get("choices") or [{}]
    return choices[0].get("delta", {}).get("content") or ""


def _wait_for(condition: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.05)
