"""load: on_demand within server.memory_budget: with room for one demo model, requests that
alternate between two models are all answered while at most one model is resident."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import APIStatusError, OpenAI

from tests.server.serverproc import REPO, running_server

pytestmark = [pytest.mark.server, pytest.mark.mlx]

# A qwen3 demo model's weights are ~39 MB: the budget holds one, not two.
BUDGET = 60_000_000


def config_text(budget: int) -> str:
    model = (
        "source: 'demo:qwen3', pipeline: qwen3, load: on_demand, options: {default_max_tokens: 4}"
    )
    return (
        f"pipelines_dir: {REPO / 'pipelines'}\n"
        f"server: {{memory_budget: {budget}}}\n"
        "models:\n"
        f"  - {{name: a, {model}}}\n"
        f"  - {{name: b, {model}}}\n"
        "endpoints:\n  - {route: /v1/chat/completions, api: openai-chat}\n"
    )


class ResidentSampler(threading.Thread):
    """Reads the resident-model gauge from /metrics until stopped."""

    def __init__(self, base: str) -> None:
        super().__init__(daemon=True)
        self.base = base
        self.samples: list[float] = []
        self.stopped = threading.Event()
        self.start()

    def run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=10) as http:
            while not self.stopped.is_set():
                self.samples.append(gauge(http.get("/metrics").text, "pipeserve_resident_models"))
                self.stopped.wait(0.05)


def gauge(metrics: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", metrics, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


@pytest.fixture(scope="module")
def budget_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = tmp_path_factory.mktemp("budget") / "budget.yaml"
    config.write_text(config_text(BUDGET))
    with running_server(config) as base:
        yield base


def test_alternating_models_fit_one_at_a_time(budget_server: str) -> None:
    base = budget_server
    client = OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0, timeout=120)
    before = {m["id"]: m["state"] for m in httpx.get(f"{base}/v1/models").json()["data"]}
    assert before == {"a": "not-loaded", "b": "not-loaded"}
    sampler = ResidentSampler(base)
    try:
        for model in ["a", "b", "a", "b", "a"]:
            reply = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}]
            )
            assert reply.model == model and reply.choices[0].finish_reason in ("stop", "length")
        # A stream for the model that is not resident: it waits for the swap, then streams.
        chunks = list(
            client.chat.completions.create(
                model="b", messages=[{"role": "user", "content": "hi"}], stream=True
            )
        )
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    finally:
        sampler.stopped.set()
        sampler.join()
    metrics = httpx.get(f"{base}/metrics").text
    assert sampler.samples and max(sampler.samples) <= 1
    assert gauge(metrics, "pipeserve_resident_models_peak") == 1
    assert gauge(metrics, 'pipeserve_model_loads_total{model="a"}') == 3
    assert gauge(metrics, 'pipeserve_model_loads_total{model="b"}') == 3
    assert gauge(metrics, "pipeserve_memory_budget_bytes") == BUDGET
    cards = {m["id"]: m for m in httpx.get(f"{base}/v1/models").json()["data"]}
    assert (cards["a"]["state"], cards["b"]["state"]) == ("not-loaded", "loaded")
    assert cards["b"]["memory_bytes"] > BUDGET // 2 and cards["a"]["memory_bytes"] == 0


def test_a_model_larger_than_the_budget_is_refused_clearly(tmp_path: Path) -> None:
    from pipeserve.loading import build_app_from_config

    config = tmp_path / "tiny.yaml"
    config.write_text(config_text(1000))
    app = build_app_from_config(config)
    client = OpenAI(
        base_url="http://test/v1",
        api_key="k",
        max_retries=0,
        http_client=httpx.Client(transport=httpx.WSGITransport(app=app)),
    )
    with pytest.raises(APIStatusError) as caught:
        client.chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 503
    assert "memory budget" in caught.value.message
