"""From a config file to a served app: validate, load models, build chains."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import falcon

from pipeserve.app import create_app
from pipeserve.config.config_checks import LoadedConfig
from pipeserve.server.registry import ServedModel, StageDecl, build_chain
from pipeserve.stages import load_builtin_stages
from pipeserve.stages.base import BuildEnv
from pipeserve.store import response_store

log = logging.getLogger("pipeserve.loading")


def build_app_from_config(path: Path | str, api_keys: Sequence[str] = ()) -> falcon.App:
    """Everything a worker needs: one runtime per model, one chain per model."""
    from pipeserve.config import load_server_config
    from pipeserve.config.auto import resolve_auto_with
    from pipeserve.engine.loader import resolve_source

    loaded = resolve_auto_with(load_server_config(Path(path)), resolve_source)
    return build_app_from_loaded(loaded, api_keys)


def build_app_from_loaded(loaded: LoadedConfig, api_keys: Sequence[str] = ()) -> falcon.App:
    """The app of a validated config whose `pipeline: auto` entries are resolved."""
    from pipeserve.engine.runtime import build_runtime

    load_builtin_stages()
    served: list[ServedModel] = []
    for entry in loaded.config.models:
        pipeline = loaded.pipelines[entry.pipeline]
        runtime = build_runtime(entry)
        env = BuildEnv(model_name=entry.name, family=pipeline.family, runtime=runtime)
        chain = build_chain(stage_decls(pipeline), env)
        served.append(
            ServedModel(entry=entry, family=pipeline.family, runtime=runtime, chain=chain)
        )
        log.info(
            "model %s ready: %s via %s engine, pipeline %s",
            entry.name,
            entry.source,
            entry.engine,
            entry.pipeline,
        )
    store = response_store(loaded.config.server, loaded.path.parent)
    return create_app(loaded.config, served, api_keys=api_keys, store=store)


def stage_decls(pipeline: Any) -> list[StageDecl]:
    return [StageDecl(kind=s.kind, params=s.params, role=s.role) for s in pipeline.stages]
