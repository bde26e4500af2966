"""The console's JSON endpoints (docs/console.md). They obey the API keys as the APIs
do: with keys configured each needs one; `models` lists what the key may use, while
`live` and `config` name every model and need a key without a model limit (as /metrics)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import falcon

from pipeserve.api.base import WireProtocol
from pipeserve.config.models import ServerConfig
from pipeserve.server.auth import Grant, KeyRing, openai_auth, unrestricted
from pipeserve.server.console.config_view import ConfigSource, config_view
from pipeserve.server.console.models_view import describe_model
from pipeserve.server.console.recent import BUCKET_SECONDS, WINDOW_SECONDS, RecentActivity
from pipeserve.server.registry import ModelTable


class ConsoleModels:
    """GET /console/api/models: the models this key may use, described for people."""

    def __init__(
        self,
        table: ModelTable,
        config: ServerConfig,
        protocols: Mapping[str, WireProtocol],
        keys: KeyRing,
        config_dir: Path,
    ) -> None:
        self.table = table
        self.config = config
        self.protocols = protocols
        self.keys = keys
        self.config_dir = config_dir

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        grant: Grant | None = openai_auth(req, resp, self.keys)
        if grant is None:
            return
        scope = grant.scope(None)
        endpoints = self.config.endpoints
        resp.media = {
            "models": [
                describe_model(m, endpoints, self.protocols, self.config_dir)
                for m in self.table.models
                if scope is None or m.name in scope
            ],
            "endpoints": [{"route": e.route, "api": e.api} for e in endpoints],
            "auth": self.keys.enabled,
        }


class ConsoleLive:
    """GET /console/api/live: requests in flight, queue, output per second and TTFT
    percentiles over the last minutes, in buckets (this worker's view)."""

    def __init__(self, table: ModelTable, recent: RecentActivity, keys: KeyRing) -> None:
        self.table = table
        self.recent = recent
        self.keys = keys

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        if not unrestricted(req, resp, self.keys, "the live view"):
            return
        models = [self._model(name, stats) for name, stats in self.table.stats().items()]
        self.recent.note_queue(sum(m["queue"] for m in models))
        resp.media = {
            "window_s": WINDOW_SECONDS,
            "bucket_s": BUCKET_SECONDS,
            "in_flight": self.recent.in_flight,
            "queue": sum(m["queue"] for m in models),
            "models": models,
            "series": self.recent.series(),
        }

    @staticmethod
    def _model(name: str, stats: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "name": name,
            "in_flight": int(stats.get("in_flight", stats.get("active_sequences", 0))),
            "active": int(stats.get("active_sequences", 0)),
            "queue": int(stats.get("queue_depth", 0)),
        }


class ConsoleConfig:
    """GET /console/api/config: the YAML this worker runs (API keys redacted) and the
    outcome of the last reload, with each problem's position when it was refused."""

    def __init__(self, config: ServerConfig, source: ConfigSource, keys: KeyRing) -> None:
        self.config = config
        self.source = source
        self.keys = keys

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        if not unrestricted(req, resp, self.keys, "the config view"):
            return
        resp.media = config_view(self.source, self.config)
