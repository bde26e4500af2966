"""From a config file to a served app: validate, load models, build chains."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pipeserve.config.config_checks import LoadedConfig
from pipeserve.live_app import LiveApp


def build_app_from_config(path: Path | str, api_keys: Sequence[str] = ()) -> LiveApp:
    """Everything a worker needs: one runtime per model, one chain per model."""
    from pipeserve.config import load_server_config
    from pipeserve.config.auto import resolve_auto_with
    from pipeserve.engine.weights.loader import resolve_source

    loaded = load_server_config(Path(path))
    sha256 = {entry.source: entry.sha256 for entry in loaded.config.models}
    loaded = resolve_auto_with(loaded, lambda source: resolve_source(source, sha256.get(source)))
    return build_app_from_loaded(loaded, api_keys)


def build_app_from_loaded(
    loaded: LoadedConfig,
    api_keys: Sequence[str] = (),
    workers: int = 1,
    engine_host: Path | None = None,
    reload_status: Path | None = None,
    shard_hosts: dict[str, Path] | None = None,
    host_secret: str = "",
) -> LiveApp:
    """The app of a validated config whose `pipeline: auto` entries are resolved: a WSGI
    callable whose models and routes a config reload replaces in place. With
    `engine_host` (a Unix socket), the models run there, once for all workers.
    `reload_status`: the file where the master records its last reload's outcome. A
    model named in `shard_hosts` runs in its own shard host (a sharded model).
    `host_secret`: the server's secret that the engine and shard hosts check (wire.py)."""
    return LiveApp(
        loaded,
        api_keys=api_keys,
        workers=workers,
        engine_host=engine_host,
        reload_status=reload_status,
        shard_hosts=shard_hosts,
        host_secret=host_secret,
    )
