"""SIGHUP reloads the config: a broken one is refused (old keeps serving, positioned error
in the log), a valid one adds and changes models without a restart while a stream that
started before it finishes, and an unchanged model is not reloaded."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from openai import NotFoundError, OpenAI

from tests.server.serverproc import REPO, server_process

pytestmark = pytest.mark.server

WORDS = " ".join(f"w{i}" for i in range(40))
SLOW = f"{{name: slow, source: 'demo:qwen3', pipeline: qwen3, engine: replay, replay: {{completion: '{WORDS}', delay: 0.1}}}}"
STEADY = "{name: steady, source: 'demo:qwen3', pipeline: qwen3, engine: replay, replay: {completion: 'steady answer'}}"
GONE = "{name: gone, source: 'demo:qwen3', pipeline: qwen3, engine: replay}"
ENDPOINTS = "endpoints:\n  - {route: /v1/chat/completions, api: openai-chat}\n"


def config_text(*models: str, extra_route: str = "") -> str:
    lines = [f"pipelines_dir: {REPO / 'pipelines'}", "models:"] + [f"  - {m}" for m in models]
    return "\n".join(lines) + "\n" + ENDPOINTS + extra_route


def test_sighup_refuses_a_broken_config_then_applies_a_valid_one(tmp_path: Path) -> None:
    config = tmp_path / "live.yaml"
    config.write_text(config_text(SLOW, STEADY, GONE))
    with server_process(config) as (base, proc):
        log = Path(os.environ.get("PYTEST_SERVER_LOG_DIR", "/tmp")) / (
            f"pipeserve-test-{base.rsplit(':', 1)[1]}.log"
        )
        client = OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0)

        # 1. A typo: refused with its position; the running config keeps serving.
        config.write_text(
            config_text(SLOW, STEADY, GONE).replace("pipeline: qwen3", "pipelin: qwen3", 1)
        )
        os.kill(proc.pid, signal.SIGHUP)
        wait_for(lambda: "reload refused" in log.read_text())
        assert re.search(
            rf"{re.escape(str(config))}:3:\d+: models\[0\]\.pipelin: unknown key 'pipelin'",
            log.read_text(),
        )
        assert proc.poll() is None
        assert answer(client, "steady") == "steady answer"

        # 2. A stream in progress, then a valid config: `slow` changes, `added` is new
        #    (and auto-detected), `gone` is removed, `steady` is unchanged, a route is added.
        stream = StreamReader(base, "slow")
        wait_for(lambda: len(stream.pieces) >= 3)
        added = "{name: added, source: 'demo:qwen3', pipeline: auto, engine: replay, replay: {completion: 'new model'}}"
        changed = SLOW.replace(WORDS, "changed answer").replace("delay: 0.1", "delay: 0")
        new_route = "  - {route: /v2/chat, api: openai-chat, models: [added]}\n"
        config.write_text(config_text(changed, STEADY, added, extra_route=new_route))
        os.kill(proc.pid, signal.SIGHUP)
        wait_for(lambda: "added" in model_ids(base), timeout=120)
        reload_seen = time.monotonic()

        assert answer(client, "added") == "new model"
        body = {"model": "added", "messages": [{"role": "user", "content": "x"}]}
        routed = httpx.post(f"{base}/v2/chat", json=body, timeout=30).json()  # a new route
        assert routed["choices"][0]["message"]["content"] == "new model"
        assert answer(client, "slow") == "changed answer"
        assert answer(client, "steady") == "steady answer"
        assert "gone" not in model_ids(base)
        with pytest.raises(NotFoundError):
            answer(client, "gone")
        stream.join()
        assert stream.ended_at > reload_seen, "the stream ended before the reload: test is void"
        assert stream.done and "".join(stream.pieces) == WORDS  # the old model finished it
        assert proc.poll() is None
        metrics = httpx.get(f"{base}/metrics").text
        assert 'pipeserve_model_loads_total{model="steady"} 1.0' in metrics  # not reloaded
        assert 'pipeserve_config_reloads_total{outcome="applied"} 1.0' in metrics


class StreamReader(threading.Thread):
    def __init__(self, base: str, model: str) -> None:
        super().__init__(daemon=True)
        self.base, self.model = base, model
        self.pieces: list[str] = []
        self.done = False
        self.ended_at = 0.0
        self.start()

    def run(self) -> None:
        body = {"model": self.model, "stream": True, "messages": [{"role": "user", "content": "x"}]}
        with httpx.stream("POST", f"{self.base}/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    choices = json.loads(line[6:])["choices"]
                    self.pieces.append(
                        (choices[0]["delta"].get("content") or "") if choices else ""
                    )
        self.ended_at = time.monotonic()


def answer(client: OpenAI, model: str) -> str:
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}])
    return reply.choices[0].message.content or ""


def model_ids(base: str) -> list[str]:
    return [m["id"] for m in httpx.get(f"{base}/v1/models", timeout=10).json()["data"]]


def wait_for(condition: object, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.1)
