"""The console's Config view redacts secrets by their place in the parsed YAML (issue 34):
an API key however it is written, and every libpq secret of the store's URL."""

from __future__ import annotations

from typing import Any

import pytest

from pipeserve.config.models import ServerConfig
from pipeserve.server.console.config_view import REDACTED, redact_secrets

BASE: dict[str, Any] = {
    "models": [{"name": "r", "source": "x", "pipeline": "p"}],
    "endpoints": [{"route": "/v1/chat/completions", "api": "openai-chat"}],
}


def config(server: dict[str, Any]) -> ServerConfig:
    return ServerConfig.model_validate({"server": server, **BASE})


@pytest.mark.parametrize(
    "written",
    [
        '- {name: team, models: [r], key: "sk-\\x41quoted\\x21"}',  # escaped, not first
        '- name: team\n    key: "sk-\\u0041quoted\\u0021"',
        "- {name: team, key: 'sk-Aquoted!'}",
        '- "sk-\\x41quoted\\x21"',
    ],
)
def test_an_api_key_is_redacted_however_it_is_written(written: str) -> None:
    text = f"server:\n  api_keys:\n    {written}\n"
    shown = redact_secrets(text, config({"api_keys": [{"key": "sk-Aquoted!", "name": "team"}]}))
    assert "quoted" not in shown and "x41" not in shown and "u0041" not in shown
    assert REDACTED in shown


@pytest.mark.parametrize(
    ("url", "kept"),
    [
        ("postgresql://u@db.internal/p?sslmode=verify-full&sslpassword=Secret-2", "verify-full"),
        ("postgresql://u:Secret-1@db.internal/p?sslpassword=Secret-2&password=Secret-3", "u:"),
    ],
)
def test_every_libpq_secret_of_the_store_url_is_redacted(url: str, kept: str) -> None:
    text = f'server:\n  responses_store:\n    url: "{url}"\n'
    shown = redact_secrets(text, config({"responses_store": {"url": url}}))
    assert "Secret" not in shown
    assert kept in shown and "db.internal" in shown
