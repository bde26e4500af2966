"""A GGUF without a chat template (a base model) on a real server: /v1/completions and
Ollama's /api/generate with raw work, a chat request answers 400 naming the
`chat_template:` option, and a model given `chat_template: chatml` answers chat."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from gguf import GGMLQuantizationType as T

from tests.engine.weights.gguf_fixtures import write_tiny_gguf
from tests.server.serverproc import running_server, server_log, server_process

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("base")
    gguf = write_tiny_gguf(folder / "base.gguf", "llama", T.Q8_0, vocab="spm")
    config = folder / "config.yaml"  # no pipelines_dir: the shipped pipelines
    config.write_text(
        "models:\n"
        f"  - {{name: base, source: {gguf}, pipeline: auto}}\n"
        f"  - {{name: templated, source: {gguf}, pipeline: chatml, chat_template: chatml}}\n"
        "endpoints:\n"
        "  - {route: /v1/completions, api: openai-completions}\n"
        "  - {route: /v1/chat/completions, api: openai-chat}\n"
        "  - {route: /api, api: ollama}\n"
    )
    env = {"PIPESERVE_HOME": os.environ.get("PIPESERVE_HOME", str(folder / "home"))}
    with running_server(config, env) as base:
        yield base


def test_completions_and_raw_generate_work(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)
    reply = client.completions.create(model="base", prompt="the world", max_tokens=5)
    assert reply.usage is not None and reply.usage.completion_tokens == 5
    answer = httpx.post(f"{server}/api/generate", timeout=60, json={
        "model": "base", "prompt": "the world", "raw": True, "stream": False,
        "options": {"num_predict": 5}})  # fmt: skip
    assert answer.status_code == 200 and answer.json()["done"] is True


def test_chat_without_a_template_is_a_400_naming_the_option(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="base", messages=[{"role": "user", "content": "hi"}])
    message = caught.value.response.json()["error"]["message"]
    assert message.startswith("Model 'base' has no chat template (a base model): send a plain")
    assert "`chat_template:` in its config entry" in message
    ollama = httpx.post(f"{server}/api/chat", timeout=60, json={
        "model": "base", "messages": [{"role": "user", "content": "hi"}], "stream": False})  # fmt: skip
    assert ollama.status_code == 400 and "has no chat template" in ollama.text


def test_a_configured_template_answers_chat(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(
        model="templated", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert reply.usage is not None and reply.usage.prompt_tokens > 3


def test_a_bad_gguf_in_a_reload_is_refused_and_the_models_keep_serving(tmp_path: Path) -> None:
    from tests.server.test_reload import wait_for

    gguf = write_tiny_gguf(tmp_path / "base.gguf", "llama", T.Q8_0, vocab="spm")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf.read_bytes()[:-100])  # the last tensor's data runs past the end
    config = tmp_path / "live.yaml"
    head = f"models:\n  - {{name: base, source: {gguf}, pipeline: chatml}}\n"
    tail = "endpoints:\n  - {route: /v1/completions, api: openai-completions}\n"
    config.write_text(head + tail)
    env = {"PIPESERVE_HOME": os.environ.get("PIPESERVE_HOME", str(tmp_path / "home"))}
    with server_process(config, env) as (base, proc):
        config.write_text(head + f"  - {{name: cut, source: {cut}, pipeline: chatml}}\n" + tail)
        os.kill(proc.pid, signal.SIGHUP)
        log = server_log(base)
        wait_for(lambda: "reload refused" in log.read_text())
        assert (
            f"models[1].source: {cut}: tensor output_norm.weight (F32, 64) needs" in log.read_text()
        )
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        reply = client.completions.create(model="base", prompt="the world", max_tokens=3)
        assert reply.usage is not None and reply.usage.completion_tokens == 3
