"""What the console's Config view shows: the YAML the server runs, with API keys and
the response store's database secrets redacted, and the outcome of the last reload
(written by the gunicorn master, which validates reloads, into a file beside its config
snapshot; read by the workers).

Redaction goes by position in the parsed YAML (`secret_spans`): the text of every
`server.api_keys` entry's key, however it is written (quoted, escaped, in a flow
mapping, through an anchor), and the secret parts of `server.responses_store.url`
(the URL's password, and libpq's `password` / `sslpassword` parameters, in a URL's
query or a `key=value` connection string). Then, belt and braces, every secret's value
wherever else it appears (a comment)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import yaml

from pipeserve.config.models import ServerConfig

REDACTED = "<redacted>"
LIBPQ_SECRETS = frozenset({"password", "sslpassword"})  # libpq parameters that are secrets


@dataclass(frozen=True)
class ConfigSource:
    """The config a worker serves: its file, its text as validated, its pipelines' files."""

    path: str = ""
    text: str = ""
    pipelines: Sequence[tuple[str, str, str]] = ()  # (name, path, text)
    reload_status: Path | None = None  # the master's last reload outcome (JSON), if any


def redact_secrets(text: str, config: ServerConfig) -> str:
    """The text with every configured API key and the store's secrets replaced."""
    for start, end, replacement in sorted(secret_spans(text), reverse=True):
        text = text[:start] + replacement + text[end:]
    keys = [entry.key.get_secret_value() for entry in config.server.api_keys]
    for secret in sorted([*keys, *store_passwords(config)], key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return "\n".join(_redact_key_lines(text.split("\n"), config))


def secret_spans(text: str) -> list[tuple[int, int, str]]:
    """(start, end, replacement) of each secret scalar in the YAML text, by its place in
    the document (see the module doc); none when the text does not parse."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return []
    server = _child(root, "server")
    spans: dict[tuple[int, int], str] = {}
    keys = _child(server, "api_keys")
    for entry in keys.value if isinstance(keys, yaml.SequenceNode) else []:
        node = entry if isinstance(entry, yaml.ScalarNode) else _child(entry, "key")
        if isinstance(node, yaml.ScalarNode):
            spans[_span(node)] = REDACTED
    url = _child(_child(server, "responses_store"), "url")
    if isinstance(url, yaml.ScalarNode) and str(url.value) != redact_url(str(url.value)):
        spans[_span(url)] = "'" + redact_url(str(url.value)).replace("'", "''") + "'"
    return [(start, end, replacement) for (start, end), replacement in spans.items()]


def _child(node: Any, key: str) -> Any:
    if not isinstance(node, yaml.MappingNode):
        return None
    return next(
        (v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == key), None
    )


def _span(node: yaml.Node) -> tuple[int, int]:
    return node.start_mark.index, node.end_mark.index


def redact_url(url: str) -> str:
    """A libpq URL or `key=value` connection string with its secrets replaced."""
    if "://" not in url:
        return " ".join(_redact_pair(pair) for pair in url.split(" "))
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.partition(':')[0]}:{REDACTED}@{host}"
    query = "&".join(_redact_pair(pair) for pair in parts.query.split("&")) if parts.query else ""
    return parts._replace(netloc=netloc, query=query).geturl()


def _redact_pair(pair: str) -> str:
    key, eq, _ = pair.partition("=")
    return f"{key}={REDACTED}" if eq and unquote(key).strip().lower() in LIBPQ_SECRETS else pair


def store_passwords(config: ServerConfig) -> list[str]:
    """The secrets of a PostgreSQL `responses_store.url` (`user:pw@`, and libpq's secret
    parameters, `?password=`, `?sslpassword=`, or `password=...` in a connection string),
    as written (the docs advise PGPASSWORD, but a URL may still carry one)."""
    store = config.server.responses_store
    url = store.url if store else None
    if not url:
        return []
    if "://" not in url:
        pairs, password = url.split(" "), None
    else:
        parts = urlsplit(url)
        pairs, password = parts.query.split("&"), parts.password
    found = [
        v for k, _, v in (p.partition("=") for p in pairs) if unquote(k).lower() in LIBPQ_SECRETS
    ]
    return [pw for pw in [password, *found] if pw]


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
