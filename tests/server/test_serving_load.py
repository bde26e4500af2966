"""Serving under load on the real MLX demo model: hub responsiveness, batching,
disconnects, backpressure. Generous bounds only: they fail when something blocks."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.serverproc import REPO, running_server

pytestmark = [pytest.mark.server, pytest.mark.mlx]

CONFIG = """
server: {{host: 127.0.0.1, port: 8080}}
pipelines_dir: {pipelines}
models:
  - name: demo
    source: demo:qwen3
    pipeline: qwen3
    options: {{max_batch: {max_batch}, queue_size: {queue_size}}}
endpoints:
  - {{route: /v1/chat/completions, api: openai-chat}}
  - {{route: /v1/messages, api: anthropic-messages}}
"""


def write_config(tmp: Path, max_batch: int, queue_size: int) -> Path:
    path = tmp / f"serve-{max_batch}-{queue_size}.yaml"
    path.write_text(
        CONFIG.format(pipelines=REPO / "pipelines", max_batch=max_batch, queue_size=queue_size)
    )
    return path


@pytest.fixture(scope="module")
def batch_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_server(write_config(tmp_path_factory.mktemp("cfg"), 8, 8)) as base:
        yield base


def chat_body(content: str, max_tokens: int, stream: bool = False) -> dict[str, object]:
    return {
        "model": "demo",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        "reasoning_effort": "none",
    }


def chat(base: str, content: str, max_tokens: int, stream: bool = False) -> httpx.Response:
    body = chat_body(content, max_tokens, stream)
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300)


def metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    match = re.search(rf"^{name}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def stream_chunk_times(base: str, content: str, max_tokens: int, into: list[float]) -> None:
    """Stream a chat answer, appending the arrival time of every SSE data line to `into`."""
    body = chat_body(content, max_tokens, stream=True)
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=300) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: "):
                into.append(time.monotonic())


def test_health_answers_while_eight_streams_decode(batch_server: str) -> None:
    # Ordering, not timing: /health must be answered *between* the token chunks of the
    # streams (the hub is not blocked while the engine thread decodes), so probes are
    # placed on the streams' own timelines instead of compared with a latency bound.
    chunk_times: list[list[float]] = [[] for _ in range(8)]
    threads = [
        threading.Thread(
            target=stream_chunk_times, args=(batch_server, f"story {i}", 256, chunk_times[i])
        )
        for i in range(8)
    ]
    for thread in threads:
        thread.start()
    answered: list[float] = []
    with httpx.Client(timeout=30) as probe:
        while any(t.is_alive() for t in threads):
            assert probe.get(f"{batch_server}/health").status_code == 200
            answered.append(time.monotonic())
    for thread in threads:
        thread.join()
    assert all(len(times) > 8 for times in chunk_times), [len(t) for t in chunk_times]
    all_decoding = (max(t[0] for t in chunk_times), min(t[-1] for t in chunk_times))
    inside = [at for at in answered if all_decoding[0] < at < all_decoding[1]]
    # A hub blocked by decoding would answer only before the first or after the last chunk.
    assert len(inside) >= 3, (len(inside), len(answered), all_decoding)


def test_batched_equals_one_by_one(batch_server: str) -> None:
    prompts = [f"count to {n}" for n in range(4)]
    alone = [chat(batch_server, p, 24).json()["choices"][0]["message"]["content"] for p in prompts]
    results: dict[int, str] = {}

    def run(i: int) -> None:
        results[i] = chat(batch_server, prompts[i], 24).json()["choices"][0]["message"]["content"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [results[i] for i in range(4)] == alone


def test_disconnect_frees_the_slot(batch_server: str) -> None:
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "go on forever"}],
        "max_tokens": 4000,
        "stream": True,
    }
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{batch_server}/v1/chat/completions", json=body) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith("data: ") and '"content"' in line)
            assert metric(batch_server, "pipeserve_active_sequences") >= 1
    deadline = time.monotonic() + 30
    while metric(batch_server, "pipeserve_active_sequences") > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(batch_server, "pipeserve_active_sequences") == 0


def test_overload_gets_429_and_529(tmp_path: Path) -> None:
    with running_server(write_config(tmp_path, 1, 0)) as base:
        long_body = {
            "model": "demo",
            "messages": [{"role": "user", "content": "long"}],
            "max_tokens": 4000,
            "stream": True,
        }
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", f"{base}/v1/chat/completions", json=long_body) as resp,
        ):
            lines = resp.iter_lines()  # keep it referenced: closing it closes the response
            next(line for line in lines if line.startswith("data: "))
            busy = chat(base, "hi", 4)
            assert busy.status_code == 429
            assert busy.json()["error"]["type"] == "rate_limit_error"
            assert busy.headers.get("retry-after")
            anthropic_busy = httpx.post(
                f"{base}/v1/messages",
                json={
                    "model": "demo",
                    "max_tokens": 4,
                    "messages": [{"role": "user", "content": "hi"}],
                },
                timeout=30,
            )
            assert anthropic_busy.status_code == 529
            assert anthropic_busy.json()["error"]["type"] == "overloaded_error"
        # The slot is free again once the first client left.
        deadline = time.monotonic() + 30
        while chat(base, "hi", 4).status_code == 429 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert chat(base, "hi", 4).status_code == 200


def test_metrics_exposed(batch_server: str) -> None:
    chat(batch_server, "hello", 4)
    text = httpx.get(f"{batch_server}/metrics", timeout=10).text
    for name in (
        "pipeserve_requests_total",
        "pipeserve_completion_tokens_total",
        "pipeserve_time_to_first_token_seconds_bucket",
        "pipeserve_queue_depth",
    ):
        assert name in text
    assert json.loads(httpx.get(f"{batch_server}/health", timeout=10).text)["status"] == "ok"
