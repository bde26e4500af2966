"""With `server.workers: 2` the chat model decodes in the engine host while each worker
runs its own embedding engine: the embedding engine still gives way to that chat
(server/remote/chat_activity.py). A real server: embeddings sent while a chat stream
decodes in the host run as yielded batches (pipeserve_embedding_yielded_batches rises),
embeddings sent with no chat running do not."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.serverproc import REPO, running_server

pytestmark = [pytest.mark.server, pytest.mark.mlx]

CONFIG = f"""
pipelines_dir: {REPO / "pipelines"}
server: {{workers: 2}}
models:
  - {{name: chat, source: "demo:qwen3", pipeline: qwen3}}
  - name: emb
    kind: embedding
    source: demo:qwen3
    embedding: {{pooling: mean, chat_share: 0.5}}
endpoints:
  - {{route: /v1/chat/completions, api: openai-chat}}
  - {{route: /v1/embeddings, api: openai-embeddings}}
"""
NO_EOS = {"151643": -100, "151645": -100}  # the demo's EOS ids: it decodes until cancelled
YIELDED = re.compile(r'^pipeserve_embedding_yielded_batches\{model="emb"\} (\S+)$', re.M)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = tmp_path_factory.mktemp("workers") / "config.yaml"
    config.write_text(CONFIG)
    with running_server(config) as base:
        yield base


def yielded(client: httpx.Client) -> float:
    match = YIELDED.search(client.get("/metrics").text)
    assert match is not None
    return float(match.group(1))


def embed(client: httpx.Client) -> None:
    answer = client.post("/v1/embeddings", json={"model": "emb", "input": ["one", "two"]})
    assert answer.status_code == 200, answer.text
    assert answer.headers.get("connection") != "close"  # the next request: the same worker


def test_embeddings_give_way_to_the_hosts_chat(server: str, tmp_path: Path) -> None:
    # one keep-alive connection: the embeddings and /metrics reach the same worker
    with httpx.Client(base_url=server, timeout=60) as client:
        embed(client)
        quiet = yielded(client)
        embed(client)
        assert yielded(client) == quiet  # no chat: nothing yielded
        sdk = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)
        decoding, done = threading.Event(), threading.Event()

        def chat() -> None:
            stream = sdk.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": "go on"}],
                max_tokens=4000, stream=True, logit_bias=NO_EOS,
            )  # fmt: skip
            with stream:
                for _ in stream:
                    decoding.set()
                    if done.is_set():
                        break  # leaving the stream cancels the request

        talker = threading.Thread(target=chat)
        talker.start()
        try:
            assert decoding.wait(60)
            during = quiet
            for _ in range(100):  # the host publishes every 50 ms: a few tries at most
                embed(client)
                during = yielded(client)
                if during > quiet or not talker.is_alive():
                    break
        finally:
            done.set()
            talker.join(60)
    assert during > quiet
