"""The console's JSON endpoints without a browser: the Config view after a refused reload
(each problem with its position, the running YAML unchanged), `server.console: false`
turning the console off, API keys redacted from the YAML shown, and the Live window's
buckets (in flight carried over quiet seconds, TTFT percentiles)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeserve.config.models import ServerConfig
from pipeserve.server.console.config_view import REDACTED, redact_secrets
from pipeserve.server.console.recent import BUCKET_SECONDS, RecentActivity
from tests.server.serverproc import REPO, server_process

MODEL = "{name: r, source: 'demo:qwen3', pipeline: qwen3, engine: replay}"


def config_text(server: str = "") -> str:
    return (
        f"pipelines_dir: {REPO / 'pipelines'}\n{server}models:\n  - {MODEL}\n"
        "endpoints:\n  - {route: /v1/chat/completions, api: openai-chat}\n"
    )


def wait_for(check: Any, what: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.2)
    return found


@pytest.mark.server
def test_config_view_shows_a_refused_reload_and_the_console_can_be_turned_off(
    tmp_path: Path,
) -> None:
    config = tmp_path / "console.yaml"
    config.write_text(config_text())
    with server_process(config) as (base, proc):
        page = httpx.get(f"{base}/")
        assert page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert httpx.get(f"{base}/console/static/app.js").status_code == 200
        running = httpx.get(f"{base}/console/api/config").json()
        assert running["text"] == config.read_text() and running["reload"] is None

        config.write_text(config_text().replace("pipeline: qwen3", "pipelin: qwen3"))
        os.kill(proc.pid, signal.SIGHUP)
        view = wait_for(
            lambda: (v := httpx.get(f"{base}/console/api/config").json())["reload"] and v,
            "the refused reload to show",
        )
        assert view["reload"]["ok"] is False
        problem = next(p for p in view["reload"]["problems"] if "unknown key" in p["message"])
        assert (problem["line"], problem["path"]) == (3, "models[0].pipelin")
        assert view["text"] == running["text"]  # still serving the old config

        config.write_text(config_text("server: {console: false}\n"))
        os.kill(proc.pid, signal.SIGHUP)
        wait_for(lambda: httpx.get(f"{base}/console/api/config").status_code == 404, "reload")
        assert httpx.get(f"{base}/").json()["service"] == "pipeserve"
        assert httpx.get(f"{base}/console/static/app.js").status_code == 404


def test_api_keys_are_redacted_from_the_yaml_shown() -> None:
    text = (
        "server:\n  api_keys:\n    - sk-plain-one\n"
        '    - {key: "sk-\\x41quoted", name: team, models: [r]}\n'
        "    - key: 'sk-single'\n"
    )
    config = ServerConfig.model_validate(
        {
            "server": {"api_keys": ["sk-plain-one", {"key": "sk-Aquoted"}, {"key": "sk-single"}]},
            "models": [{"name": "r", "source": "x", "pipeline": "p"}],
            "endpoints": [{"route": "/v1/chat/completions", "api": "openai-chat"}],
        }
    )
    shown = redact_secrets(text, config)
    assert "sk-" not in shown
    assert shown.count(REDACTED) == 3
    assert shown.startswith("server:\n  api_keys:\n")


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://pipeserve:pw%40Secret-1@db.internal:5432/pipeserve",
        "postgresql://pipeserve@db.internal/pipeserve?sslmode=require&password=pw%40Secret-1",
    ],
)
def test_the_store_password_is_redacted_from_the_yaml_shown(url: str) -> None:
    text = f"server:\n  responses_store: {{url: '{url}'}}\n"
    config = ServerConfig.model_validate(
        {
            "server": {"responses_store": {"url": url}},
            "models": [{"name": "r", "source": "x", "pipeline": "p"}],
            "endpoints": [{"route": "/v1/chat/completions", "api": "openai-chat"}],
        }
    )
    shown = redact_secrets(text, config)
    assert "Secret" not in shown
    assert shown.count(REDACTED) == 1 and "db.internal" in shown


def test_live_buckets_carry_in_flight_and_give_ttft_percentiles() -> None:
    now = [1_000_000.0]
    recent = RecentActivity(clock=lambda: now[0])
    recent.begin()
    recent.output(ttft=0.2)
    for _ in range(9):
        recent.output()
    now[0] += 3 * BUCKET_SECONDS  # a long quiet stream: still in flight
    recent.begin()
    recent.output(ttft=0.4)
    recent.end()
    series = recent.series()
    assert [row["in_flight"] for row in series[-4:]] == [1, 1, 1, 2]
    first = series[-4]
    assert first["tokens_per_s"] == 10 / BUCKET_SECONDS and first["ttft_p50"] == 0.2
    assert series[-1]["ttft_p99"] == 0.4 and series[-1]["requests"] == 1
    recent.end()
    now[0] += BUCKET_SECONDS
    assert recent.series()[-1]["in_flight"] == 0 and recent.in_flight == 0


def test_models_view_gives_a_sharded_models_ranks_hosts_and_layers(
    replay_runtime: Any, tmp_path: Path
) -> None:
    from pipeserve.config.models import ModelEntry
    from pipeserve.server.console.models_view import sharding_of
    from pipeserve.server.registry import ServedModel
    from pipeserve.stages.base import Chain

    hosts = {"hosts": [{"ssh": "m1", "ips": ["10.0.0.1"]}, {"ssh": "m2", "ips": ["10.0.0.2"]}]}
    (tmp_path / "hosts.json").write_text(json.dumps(hosts))
    sharding = {"strategy": "pipeline", "hostfile": "hosts.json"}
    entry = ModelEntry.model_validate(
        {
            "name": "big",
            "source": "demo:qwen3",
            "pipeline": "qwen3",
            "options": {"sharding": sharding},
        }  # fmt: skip
    )
    served = ServedModel(entry, "qwen3", replay_runtime("qwen3"), Chain([], []))
    plan = sharding_of(served, tmp_path)
    assert plan is not None and plan["healthy"] is True
    # The demo qwen3 has 2 layers; rank 0 holds the last ones (mlx-lm's convention).
    assert plan["ranks"] == [
        {"rank": 0, "host": "m1", "layers": "layer 1"},
        {"rank": 1, "host": "m2", "layers": "layer 0"},
    ]
    tensor = entry.model_copy(update={"options": entry.options.model_copy(update={
        "sharding": entry.options.sharding.model_copy(update={"strategy": "tensor", "hostfile": None, "ranks": 2})})})  # fmt: skip
    plan = sharding_of(ServedModel(tensor, "qwen3", served.runtime, Chain([], [])), tmp_path)
    assert plan is not None
    assert [r["layers"] for r in plan["ranks"]] == ["a slice of every layer"] * 2


def test_models_view_states_loading_then_failed_with_the_reason(
    demo_model_dir: Any,
) -> None:
    import threading

    from pipeserve.config.models import ModelEntry
    from pipeserve.engine.runtime import build_runtime
    from pipeserve.server.console.models_view import state_of
    from pipeserve.server.fleet import Fleet

    demo_model_dir("qwen3")
    entry = ModelEntry.model_validate(
        {
            "name": "broken",
            "source": "demo:qwen3",
            "pipeline": "qwen3",
            "engine": "replay",
            "load": "on_demand",
        }  # fmt: skip
    )
    fleet, gate = Fleet(), threading.Event()
    manage = fleet.manager_for(entry)

    def fails_at_the_gate() -> Any:
        gate.wait(60)
        raise RuntimeError("the weights are truncated")

    runtime = build_runtime(entry, manage=lambda start, folder: manage(fails_at_the_gate, folder))
    engine: Any = runtime.engine
    fleet.set_current([engine], [])
    assert state_of(engine.describe()) == "on demand"
    ticket = fleet.request_load(engine)
    wait_for(lambda: engine.describe()["state"] == "loading", "the load to start")
    assert state_of(engine.describe()) == "loading"
    assert engine.describe()["loading_seconds"] >= 0
    gate.set()
    wait_for(lambda: ticket.wait(1) is not None, "the load to fail")
    facts = engine.describe()
    assert state_of(facts) == "failed"
    assert "the weights are truncated" in facts["load_error"]
    fleet.close()


def test_models_view_gives_the_kv_bytes_per_token_the_cache_holds(
    demo_model_dir: Any, tmp_path: Path
) -> None:
    """The Models view's KV cache per token equals what mlx-lm's cache arrays hold per
    position after a real prefill of the demo model (float32, every layer), and, with
    `options.kv_cache`, what mlx-lm's quantized cache holds."""
    import mlx.core as mx
    from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

    from pipeserve.config.models import KvCacheOptions
    from pipeserve.engine.weights.loader import load_model
    from pipeserve.server.console.models_view import kv_bytes_per_token

    folder = demo_model_dir("qwen3")
    model = load_model(folder, "float32", False)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1, 2, 3, 4, 5]]), cache=cache))
    held = sum(c.keys.nbytes + c.values.nbytes for c in cache)
    assert kv_bytes_per_token(folder, None) == held // cache[0].keys.shape[2]
    assert kv_bytes_per_token(tmp_path, None) is None  # no config.json (a replay engine's)
    # options.kv_cache: what mlx-lm's quantized cache holds (a 32-wide head: the demo's 16
    # is below MLX's smallest group)
    (tmp_path / "q").mkdir()
    shape = {"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2}
    (tmp_path / "q" / "config.json").write_text(json.dumps({**shape, "head_dim": 32}))
    for bits in (8, 4):
        layer = QuantizedKVCache(group_size=32, bits=bits)
        rows = mx.zeros((1, 2, 5, 32), dtype=mx.float32)
        mx.eval(layer.update_and_fetch(rows, rows))
        held = sum(a.nbytes for a in (*layer.keys, *layer.values)) // layer.keys[0].shape[2]
        options = KvCacheOptions(bits=bits, group_size=32)
        assert kv_bytes_per_token(tmp_path / "q", options) == 3 * held
