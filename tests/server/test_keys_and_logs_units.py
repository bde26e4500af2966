"""Keys and request logs without a server: constant-time comparison over every key, the
two log formats, the log settings handed to gunicorn, and validation of key scopes."""

from __future__ import annotations

import hmac
import json
import logging
from datetime import datetime
from pathlib import Path

import falcon.testing
import pytest
from pythonjsonlogger.json import JsonFormatter

from pipeserve.config.models import ApiKeyEntry, ServerConfig
from pipeserve.errors import ApiError
from pipeserve.logs import HUMAN_FORMAT, logging_config
from pipeserve.server import auth
from pipeserve.server.auth import KeyRing
from pipeserve.server.request_log import RequestRecord
from pipeserve.serving import gunicorn_options


def ring() -> KeyRing:
    entries = [
        ApiKeyEntry.model_validate({"key": "first-key"}),
        ApiKeyEntry.model_validate({"key": "second-key", "name": "ci", "models": ["a"]}),
    ]
    return KeyRing.build(entries, ["env-key"])


def request(**headers: str) -> falcon.Request:
    return falcon.testing.create_req(headers=headers)


@pytest.mark.parametrize("key", ["first-key", "second-key", "env-key", "none-of-them"])
def test_every_key_is_compared_whichever_matches(monkeypatch: pytest.MonkeyPatch, key: str) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    try:
        ring().authenticate(request(Authorization=f"Bearer {key}"))
    except ApiError as error:
        assert error.kind == "authentication" and key == "none-of-them"
    # two presented values (x-api-key, Bearer) x three keys, every time, in equal-size digests
    assert len(calls) == 6 and {len(a) for pair in calls for a in pair} == {32}


def test_grants_name_the_key_and_scope_its_models() -> None:
    keys = ring()
    assert keys.authenticate(request(**{"x-api-key": "first-key"})).key_name == "key-1"
    scoped = keys.authenticate(request(Authorization="bearer second-key"))
    assert scoped.key_name == "ci" and scoped.scope(None) == {"a"}
    assert scoped.scope({"a", "b"}) == {"a"} and scoped.scope({"b"}) == set()
    assert keys.authenticate(request(Authorization="Bearer env-key")).scope({"b"}) == {"b"}
    with pytest.raises(ApiError):
        keys.authenticate(request())
    assert KeyRing().authenticate(request()).models is None  # no keys: open


def test_plain_strings_are_unscoped_keys_and_reprs_hide_them() -> None:
    config = ServerConfig.model_validate(
        {
            "server": {"api_keys": ["plain-secret-key"]},
            "models": [{"name": "m", "source": "demo:qwen3", "pipeline": "qwen3"}],
            "endpoints": [{"route": "/v1/chat/completions", "api": "openai-chat"}],
        }
    )
    [entry] = config.server.api_keys
    assert entry.key.get_secret_value() == "plain-secret-key" and entry.models is None
    assert "plain-secret-key" not in repr(config) and "plain-secret-key" not in str(config)


def finished_record() -> RequestRecord:
    record = RequestRecord("req_1", "POST", "/v1/completions", protocol="openai-completions")
    record.model, record.key, record.status, record.stream = "demo", "ci", 200, False
    record.prompt_tokens, record.completion_tokens, record.cached_tokens = 12, 3, 4
    record.ttft_ms, record.finish_reason = 5.0, "length"
    return record


def test_human_and_json_lines(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pipeserve.request"):
        finished_record().write()
    [entry] = caplog.records
    human = logging.Formatter(HUMAN_FORMAT).format(entry)
    assert "INFO pipeserve.request: req_1 POST /v1/completions protocol=openai-completions" in human
    assert "model=demo key=ci status=200 tokens=12+3 cached=4 ttft=5.0ms" in human
    assert "finish_reason=length" in human and "client_disconnected" not in human
    params = logging_config("json", "info")["formatters"]["pipeserve"]
    formatter = JsonFormatter(**{k: v for k, v in params.items() if k != "()"})
    line = json.loads(formatter.format(entry))
    assert line["level"] == "INFO" and line["logger"] == "pipeserve.request"
    assert datetime.fromisoformat(line["time"]).tzinfo is not None
    assert line["request_id"] == "req_1" and line["prompt_tokens"] == 12
    assert line["cached_tokens"] == 4 and line["finish_reason"] == "length"
    assert line["client_disconnected"] is False and line["duration_ms"] >= 0


def test_log_format_and_level_reach_gunicorn(tmp_path: Path) -> None:
    config = ServerConfig.model_validate(
        {
            "server": {"log_format": "json", "log_level": "warning"},
            "models": [{"name": "m", "source": "demo:qwen3", "pipeline": "qwen3"}],
            "endpoints": [{"route": "/v1/chat/completions", "api": "openai-chat"}],
        }
    )
    options = gunicorn_options(config, "127.0.0.1", 1, 1, config.server.log_level)
    logconfig = options["logconfig_dict"]
    assert logconfig["root"]["level"] == "WARNING" and options["loglevel"] == "warning"
    assert logconfig["formatters"]["pipeserve"]["()"].endswith("JsonFormatter")
    assert options["accesslog"] is None  # the request log replaces gunicorn's access lines
