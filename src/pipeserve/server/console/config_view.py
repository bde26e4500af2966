"""What the console's Config view shows: the YAML the server runs, with API keys and
the response store's database password redacted, and the outcome of the last reload (written by the gunicorn master, which
validates reloads, into a file beside its config snapshot; read by the workers)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pipeserve.config.models import ServerConfig

REDACTED = "<redacted>"


@dataclass(frozen=True)
class ConfigSource:
    """The config a worker serves: its file, its text as validated, its pipelines' files."""

    path: str = ""
    text: str = ""
    pipelines: Sequence[tuple[str, str, str]] = ()  # (name, path, text)
    reload_status: Path | None = None  # the master's last reload outcome (JSON), if any


def redact_secrets(text: str, config: ServerConfig) -> str:
    """The text with every configured API key and the store's password replaced."""
    keys = [entry.key.get_secret_value() for entry in config.server.api_keys]
    for secret in sorted([*keys, *store_passwords(config)], key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return "\n".join(_redact_key_lines(text.split("\n"), config))


def store_passwords(config: ServerConfig) -> list[str]:
    """The password of a PostgreSQL `responses_store.url` (`user:pw@` or `?password=`),
    as written in the URL (the docs advise PGPASSWORD, but a URL may still carry one)."""
    store = config.server.responses_store
    url = store.url if store else None
    if not url:
        return []
    parts = urlsplit(url)
    query = [v for k, _, v in (p.partition("=") for p in parts.query.split("&")) if k == "password"]
    return [pw for pw in [parts.password, *query] if pw]


def _redact_key_lines(lines: list[str], config: ServerConfig) -> Iterable[str]:
    """Belt and braces for keys written in an escaped form (`"sk-\\x41"`): a line that
    still names a key field keeps only its key."""
    if not config.server.api_keys:
        yield from lines
        return
    for line in lines:
        stripped = line.lstrip(" -{")
        if stripped.startswith("key:") and REDACTED not in line:
            yield line[: line.index("key:") + 4] + " " + REDACTED
        else:
            yield line


def write_reload_status(path: Path, config_path: str, problems: Sequence[Any]) -> None:
    """From the master: the outcome of a reload (`problems` empty: applied)."""
    status = {
        "ok": not problems,
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "file": config_path,
        "problems": [_problem(p) for p in problems],
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(status), encoding="utf-8")
    os.replace(tmp, path)


def _problem(problem: Any) -> dict[str, Any]:
    """A config Problem (file, line, col, path, message), or a bare message."""
    if isinstance(problem, str):
        return {"file": "", "line": 0, "col": 0, "path": "", "message": problem}
    return {
        "file": problem.file,
        "line": problem.line,
        "col": problem.col,
        "path": problem.path,
        "message": problem.message,
    }


def read_reload_status(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    try:
        status = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return status if isinstance(status, dict) else None


def config_view(source: ConfigSource, config: ServerConfig) -> dict[str, Any]:
    return {
        "path": source.path,
        "text": redact_secrets(source.text, config),
        "pipelines": [
            {"name": name, "path": path, "text": text} for name, path, text in source.pipelines
        ],
        "reload": read_reload_status(source.reload_status),
    }
