"""The console's JSON endpoints without a browser: the Config view after a refused reload
(each problem with its position, the running YAML unchanged), `server.console: false`
turning the console off, API keys redacted from the YAML shown, and the Live window's
buckets (in flight carried over quiet seconds, TTFT percentiles)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeserve.config.models import ServerConfig
from pipeserve.server.console.config_view import REDACTED, redact_keys
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
    shown = redact_keys(text, config)
    assert "sk-" not in shown
    assert shown.count(REDACTED) == 3
    assert shown.startswith("server:\n  api_keys:\n")


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
