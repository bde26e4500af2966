"""`server.workers: 2`: one engine host runs the model for both gunicorn workers.

Two real servers on the same demo model, one with workers: 1 (the engine in the
worker) and one with workers: 2 (the engine in the host process); the openai SDK is
the client. Greedy answers must be the same, concurrent requests spread over both
workers must all complete, a client that leaves frees its batch slot on the host, and
a killed engine host ends the stream in flight with the protocol's error event, shows
in /health, and is restarted by the master.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import openai
import pytest
from openai import OpenAI

from tests.server.serverproc import REPO, server_log, server_process

pytestmark = [pytest.mark.server, pytest.mark.mlx]

PROMPTS = ["Say hello", "Write a haiku about the sea"]
HOST_MODULE = "pipeserve.server.remote.host"
LONG = 20000  # tokens: a stream that is still going whenever the test acts on it


def config(folder: Path, workers: int) -> Path:
    path = folder / f"workers-{workers}.yaml"
    path.write_text(
        f"pipelines_dir: {REPO / 'pipelines'}\n"
        f"server: {{workers: {workers}, log_format: json}}\n"
        "models:\n"
        "  - name: demo\n    source: 'demo:qwen3'\n    pipeline: qwen3\n"
        "    options: {max_batch: 8, queue_size: 32}\n"
        "endpoints:\n  - {route: /v1/chat/completions, api: openai-chat}\n"
    )
    return path


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with server_process(config(tmp_path_factory.mktemp("w1"), 1)) as (base, _):
        yield base


class Server(NamedTuple):
    base: str
    master: int
    config: Path


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = config(tmp_path_factory.mktemp("w2"), 2)
    with server_process(path) as (base, proc):
        yield Server(base, proc.pid, path)


def client(base: str) -> OpenAI:
    return OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(base: str, prompt: str, **extra: Any) -> dict[str, Any]:
    result = client(base).chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=40,
        temperature=0,
        **extra,
    )
    choice = result.choices[0]
    assert result.usage is not None
    return {
        "content": choice.message.content,
        "finish_reason": choice.finish_reason,
        "logprobs": choice.logprobs.model_dump() if choice.logprobs else None,
        "usage": (result.usage.prompt_tokens, result.usage.completion_tokens),
    }


def streamed(base: str, prompt: str) -> tuple[str, str | None]:
    stream = client(base).chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=40,
        temperature=0,
        stream=True,
    )
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def host_pids(master: int) -> list[int]:
    """The engine host processes the gunicorn master started."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == master and HOST_MODULE in command:
            found.append(int(entry.name))
    return found


def active_sequences(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith('pipeserve_active_sequences{model="demo"}'):
            return float(line.split()[-1])
    raise AssertionError(f"no active_sequences metric in:\n{text}")


def state(base: str, model: str) -> str:
    card = httpx.get(f"{base}/v1/models/{model}", timeout=10).json()
    return str(card["state"])


def wait_for(condition: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.1)


def test_two_workers_answer_as_one(one_worker: str, two_workers: Server) -> None:
    base, master, _ = two_workers
    assert len(host_pids(master)) == 1
    for prompt in PROMPTS:
        alone = chat(one_worker, prompt, logprobs=True, top_logprobs=2)
        assert alone["finish_reason"] == "length"  # long enough for the tests below
        assert chat(base, prompt, logprobs=True, top_logprobs=2) == alone
        assert streamed(base, prompt) == streamed(one_worker, prompt)
    # Residency comes from the engine host's fleet, in every worker.
    (card,) = httpx.get(f"{base}/v1/models", timeout=10).json()["data"]
    assert (card["state"], card["load"]) == ("loaded", "startup")
    assert 'pipeserve_model_resident{model="demo"} 1.0' in httpx.get(f"{base}/metrics").text
    schema = {"type": "json_object"}  # the grammar is rebuilt in the host from its text
    assert chat(base, PROMPTS[0], response_format=schema) == chat(
        one_worker, PROMPTS[0], response_format=schema
    )


def test_concurrent_requests_over_both_workers(two_workers: Server) -> None:
    base, _, _ = two_workers
    prompts = [f"Tell me about the number {n}" for n in range(16)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        answers = list(pool.map(lambda p: streamed(base, p), prompts))
    assert all(finish in ("length", "stop") and text for text, finish in answers)
    served_by = {
        record["pid"]
        for line in server_log(base).read_text().splitlines()
        if line.startswith("{")
        and (record := json.loads(line)).get("path") == "/v1/chat/completions"
    }
    assert len(served_by) == 2, f"requests were served by workers {served_by}"


def test_client_that_leaves_frees_its_slot(two_workers: Server) -> None:
    base, _, _ = two_workers
    stream = client(base).chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": PROMPTS[1]}],
        max_tokens=LONG,
        temperature=0,
        stream=True,
    )
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    wait_for(lambda: active_sequences(base) == 1, "the stream to be active on the host")
    stream.close()  # the client goes away mid-stream
    # Generating LONG tokens takes minutes here: only the cancel frees the slot this soon.
    wait_for(lambda: active_sequences(base) == 0, "the host to free the slot", timeout=30)


def test_killed_engine_host_fails_in_protocol_and_restarts(two_workers: Server) -> None:
    base, master, _ = two_workers
    (host,) = host_pids(master)
    stream = client(base).chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": PROMPTS[1]}],
        max_tokens=LONG,
        temperature=0,
        stream=True,
    )
    chunks = iter(stream)
    next(chunks)
    os.kill(master, signal.SIGSTOP)  # hold the restart until /health was checked
    try:
        os.kill(host, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="engine process stopped"):
            for _ in chunks:
                pass
        health = httpx.get(f"{base}/health", timeout=10)
        assert health.status_code == 503
        assert "engine host" in health.json()["unhealthy"]["demo"]
    finally:
        os.kill(master, signal.SIGCONT)
    wait_for(lambda: httpx.get(f"{base}/health", timeout=10).status_code == 200, "a new host")
    assert host_pids(master) != [host]
    text, finish = streamed(base, PROMPTS[0])
    assert text and finish == "length"


def test_reload_adds_a_model_to_the_engine_host(two_workers: Server) -> None:
    base, master, path = two_workers
    echo = (
        "  - {name: echo, source: 'demo:qwen3', pipeline: qwen3, engine: replay,"
        " load: on_demand, keep_alive: 2, replay: {completion: 'Hello from the engine host'}}\n"
    )
    path.write_text(path.read_text().replace("endpoints:", echo + "endpoints:"))
    os.kill(master, signal.SIGHUP)

    def reloaded() -> int:
        return server_log(base).read_text().count("reloaded " + str(path))

    wait_for(lambda: reloaded() == 2, "both workers to reload")
    assert state(base, "echo") == "not-loaded"  # on_demand: the host loads it when asked
    answer = client(base).chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "hi"}]
    )
    assert answer.choices[0].message.content == "Hello from the engine host"
    wait_for(lambda: state(base, "echo") == "loaded", "both workers to see it loaded")
    assert chat(base, PROMPTS[0])["finish_reason"] == "length"  # demo kept serving
    # keep_alive: the host's reaper unloads the idle on_demand model (the demo stays)
    wait_for(lambda: state(base, "echo") == "not-loaded", "the host to unload idle echo")
    assert state(base, "demo") == "loaded"
