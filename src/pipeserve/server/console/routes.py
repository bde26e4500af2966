"""The console's routes on the app: the page, its files, its JSON endpoints."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import falcon

from pipeserve.api.base import WireProtocol
from pipeserve.config.models import ServerConfig
from pipeserve.server.auth import KeyRing
from pipeserve.server.console.api import ConsoleConfig, ConsoleLive, ConsoleModels
from pipeserve.server.console.config_view import ConfigSource
from pipeserve.server.console.static import STATIC_DIR, ConsoleIndex
from pipeserve.server.metrics import Metrics
from pipeserve.server.registry import ModelTable


def add_console_routes(
    app: falcon.App[falcon.Request, falcon.Response],
    config: ServerConfig,
    source: ConfigSource,
    table: ModelTable,
    protocols: Mapping[str, WireProtocol],
    keys: KeyRing,
    metrics: Metrics,
) -> None:
    """`/` (the page), `/console/static/*` (its files) and `/console/api/*`."""
    config_dir = Path(source.path).parent if source.path else Path.cwd()
    app.add_route("/", ConsoleIndex())
    app.add_static_route("/console/static", str(STATIC_DIR))
    app.add_route("/console/api/models", ConsoleModels(table, config, protocols, keys, config_dir))
    app.add_route("/console/api/live", ConsoleLive(table, metrics.recent, keys))
    app.add_route("/console/api/config", ConsoleConfig(config, source, keys))
