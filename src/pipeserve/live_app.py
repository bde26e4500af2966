"""The WSGI app of a worker, replaceable in place when the config is reloaded.

`LiveApp(loaded)` builds every model's runtime (tokenizer; weights now for `load: startup`,
on first request for `load: on_demand`), its stage chain, and the Falcon app. `reload(new)`
builds what changed, swaps the app for new requests, and leaves requests in progress on
the objects they started with. A model whose runtime-relevant entry (source, engine,
options, load policy) is unchanged keeps its runtime and weights; if only its pipeline or
aliases changed, only its chain is rebuilt. Removed or replaced models unload once their
last request ends.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import falcon

from pipeserve.app import create_app
from pipeserve.config.config_checks import LoadedConfig
from pipeserve.config.memory import budget_bytes
from pipeserve.config.models import ModelEntry
from pipeserve.config.pipeline_checks import LoadedPipeline
from pipeserve.engine.base import Engine, ModelRuntime
from pipeserve.gevent_support import run_off_hub
from pipeserve.server.console.config_view import ConfigSource
from pipeserve.server.fleet import Fleet, FleetView
from pipeserve.server.fleet_metrics import FleetCollector
from pipeserve.server.managed_engine import ManagedEngine
from pipeserve.server.metrics import Metrics
from pipeserve.server.registry import (
    ModelTable,
    ServedModel,
    StageDecl,
    build_chain,
    build_embed_chain,
)
from pipeserve.server.remote.chat_activity import ChatActivityReader, activity_path
from pipeserve.server.remote.client import HostClient, RemoteEngine
from pipeserve.server.remote.wire import model_key
from pipeserve.stages import load_builtin_stages
from pipeserve.stages.base import BuildEnv
from pipeserve.store import worker_response_store

log = logging.getLogger("pipeserve.reload")
SHARD_STATUS_WAIT = 0.1  # seconds /health waits for a shard host's first answer after a (re)connect


@dataclass(frozen=True)
class Slot:
    runtime_key: str
    chain_key: str
    model: ServedModel


def runtime_key(entry: ModelEntry, models: list[ModelEntry] | None = None) -> str:
    """What, if changed, needs the model itself reloaded (not only its chain): its entry
    and the entry of the draft model it loads (speculative method draft)."""
    from pipeserve.engine.runtime import draft_entry

    facts = [draft_entry(models or [], entry), entry]
    return json.dumps(
        [e and e.model_dump(exclude={"aliases", "pipeline"}) for e in facts], sort_keys=True
    )


def chain_key(entry: ModelEntry, pipeline: LoadedPipeline) -> str:
    stages = [(s.kind, s.params.model_dump(mode="json")) for s in pipeline.stages]
    return json.dumps([entry.pipeline, entry.aliases, pipeline.family, stages], sort_keys=True)


class LiveApp:
    def __init__(
        self,
        loaded: LoadedConfig,
        api_keys: Sequence[str] = (),
        workers: int = 1,
        engine_host: Path | None = None,
        reload_status: Path | None = None,
        shard_hosts: dict[str, Path] | None = None,
        host_secret: str = "",
    ) -> None:
        load_builtin_stages()
        self.reload_status = reload_status  # the master's last reload outcome, for the console
        self.api_keys = tuple(api_keys)
        self.workers = workers
        self.fleet = Fleet()
        # With an engine host, the models run there; this worker holds tokenizers and chains.
        self.host = HostClient(engine_host, host_secret) if engine_host is not None else None
        # the host's chat, for this worker's embedding engines (they give way to it)
        self._host_chat = ChatActivityReader(activity_path(engine_host)) if engine_host else None
        # Sharded models run in shard hosts of their own; /health must answer quickly.
        self.shard_clients = {
            name: HostClient(path, host_secret, status_wait=SHARD_STATUS_WAIT)
            for name, path in (shard_hosts or {}).items()
        }
        self.slots: dict[str, Slot] = {}
        self.tokenizers: dict[Path, Any] = {}  # by model folder, shared by its models
        self.table = ModelTable([])
        self.reloads: Counter[str] = Counter()
        self.metrics = Metrics(lambda: self.table.stats())
        self.metrics.registry.register(FleetCollector(self._fleet_view, lambda: dict(self.reloads)))
        self._reload_lock = threading.Lock()
        self.app = self._apply(loaded)
        self.fleet.start_reaper()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        return self.app(environ, start_response)

    def reload(self, loaded: LoadedConfig) -> bool:
        """Apply a validated config; on failure the running one stays. True when applied."""
        with self._reload_lock:
            try:
                self.app = self._apply(loaded)
            except Exception:
                log.exception("reload failed in this worker; the previous config keeps serving")
                self.reloads["failed"] += 1
                return False
            self.reloads["applied"] += 1
            return True

    def _apply(self, loaded: LoadedConfig) -> falcon.App[falcon.Request, falcon.Response]:
        server = loaded.config.server
        self.fleet.budget = budget_bytes(server.memory_budget, self.workers)
        self.fleet.room_timeout = server.request_timeout
        created: list[Engine] = []
        try:
            models = loaded.config.models
            slots = {
                e.name: self._slot(e, loaded.pipelines.get(e.chain_name), created, models)
                for e in models
            }
            for slot in slots.values():
                engine = slot.model.runtime.engine
                if not isinstance(engine, ManagedEngine):  # in the engine host
                    continue
                if slot.model.entry.load == "startup" and engine.engine is None:
                    self.fleet.load_now(engine)
        except BaseException:
            for engine in created:
                engine.close()
            raise
        app = create_app(
            loaded.config,
            [s.model for s in slots.values()],
            api_keys=self.api_keys,
            store=worker_response_store(server, loaded.path.parent),
            metrics=self.metrics,
            source=config_source(loaded, self.reload_status),
            cluster_views=self._shard_cluster_views,
        )
        now = managed(slots.values())
        kept = {id(e) for e in now}
        gone = [e for e in managed(self.slots.values()) if id(e) not in kept]
        self.fleet.set_current(now, gone)
        self._log_changes(slots)
        self.slots, self.table = slots, ModelTable([s.model for s in slots.values()])
        in_use = {s.model.runtime.model_dir for s in slots.values()}
        self.tokenizers = {d: t for d, t in self.tokenizers.items() if d in in_use}
        return app

    def _slot(
        self,
        entry: ModelEntry,
        pipeline: LoadedPipeline | None,
        created: list[Engine],
        models: list[ModelEntry],
    ) -> Slot:
        assert pipeline is not None  # validated: every model has its pipeline
        if entry.kind != "generation":  # embedding / rerank: the embedding chain
            return self._embedding_slot(entry, pipeline, created)
        old = self.slots.get(entry.name)
        rkey, ckey = runtime_key(entry, models), chain_key(entry, pipeline)
        if old is not None and old.runtime_key == rkey and old.chain_key == ckey:
            return old
        if old is not None and old.runtime_key == rkey:
            runtime = replace(old.model.runtime, family=entry.pipeline)
        else:
            manage = self._manager(entry, models)
            runtime = run_off_hub(lambda: build_runtime(entry, manage, self.tokenizers, models))
            created.append(runtime.engine)
        env = BuildEnv(model_name=entry.name, family=pipeline.family, runtime=runtime)
        decls = [StageDecl(kind=s.kind, params=s.params, role=s.role) for s in pipeline.stages]
        served = ServedModel(
            entry=entry,
            family=pipeline.family,
            runtime=runtime,
            chain=build_chain(decls, env),
            stages=tuple(decls),
        )
        return Slot(rkey, ckey, served)

    def _embedding_slot(
        self, entry: ModelEntry, pipeline: LoadedPipeline, created: list[Engine]
    ) -> Slot:
        """An embedding or rerank model: its runtime (kept while its entry is unchanged)
        and its embedding chain. It always runs in this worker's own fleet."""
        from pipeserve.engine.embedding.runtime import build_embedding_runtime
        from pipeserve.engine.weights.loader import resolve_source
        from pipeserve.stages.base import Chain

        old = self.slots.get(entry.name)
        rkey, ckey = runtime_key(entry), chain_key(entry, pipeline)
        if old is not None and old.runtime_key == rkey and old.chain_key == ckey:
            return old
        if old is not None and old.runtime_key == rkey:
            runtime = old.model.runtime
        else:
            manage = self.fleet.manager_for(entry)

            def build() -> ModelRuntime:
                model_dir = resolve_source(entry.source, entry.sha256)
                return build_embedding_runtime(entry, model_dir, manage, self._chat_running)

            runtime = run_off_hub(build)
            created.append(runtime.engine)
        decls = [StageDecl(kind=s.kind, params=s.params, role=s.role) for s in pipeline.stages]
        served = ServedModel(
            entry=entry,
            family=entry.kind,
            runtime=runtime,
            chain=Chain([], []),
            stages=tuple(decls),
            embed_chain=build_embed_chain(decls),
        )
        return Slot(rkey, ckey, served)

    def _chat_running(self) -> bool:
        """Whether a generation model decodes now (embedding engines give way to it):
        this worker's own, or the engine host's (its published count: chat_activity.py).
        Called from embedding engine threads: nothing here needs the hub."""
        if self._host_chat is not None and self._host_chat.chat_running():
            return True
        engines = [m.runtime.engine for m in self.table.models if m.entry.kind == "generation"]
        return any(
            e.stats().get("active_sequences", 0) > 0
            for e in engines
            if isinstance(e, ManagedEngine)
        )

    def _log_changes(self, slots: dict[str, Slot]) -> None:
        if not self.slots:
            return
        for name, slot in slots.items():
            old = self.slots.get(name)
            if old is None:
                log.info("reload: model %s added", name)
            elif old.runtime_key != slot.runtime_key:
                log.info("reload: model %s changed; reloaded", name)
            elif old is not slot:
                log.info("reload: model %s: pipeline or aliases changed; weights kept", name)
        for name in self.slots.keys() - slots.keys():
            log.info("reload: model %s removed (unloads when its requests end)", name)

    def _manager(self, entry: ModelEntry, models: list[ModelEntry]) -> Manage:
        """How the model's engine is made: a ManagedEngine of this worker's fleet, or a
        RemoteEngine for the engine host's one (its start, the local load, is never called)."""
        host = self.shard_clients.get(entry.name, self.host)
        if host is None:
            from pipeserve.engine.runtime import draft_entry

            return self.fleet.manager_for(entry, draft_entry(models, entry))

        def remote(start: Callable[[], Engine], model_dir: Path) -> Engine:
            return RemoteEngine(
                entry.name,
                model_key(entry),
                host,
                accepts_mock_response=entry.engine == "replay",
                max_tokens_limit=entry.options.max_tokens_limit,
                load=entry.load,
            )

        return remote

    def _shard_cluster_views(self) -> list[dict[str, Any]]:
        """/v1/cluster's part from each shard host that answers (node-placed models)."""
        statuses = [client.status() for client in self.shard_clients.values()]
        return [s["cluster"] for s in statuses if s is not None and "cluster" in s]

    def _fleet_view(self) -> FleetView:
        return self.host.fleet_view() if self.host is not None else self.fleet.view()

    def close(self) -> None:
        self.fleet.close()


def config_source(loaded: LoadedConfig, reload_status: Path | None) -> ConfigSource:
    """The config as the console shows it: its text as validated, its pipelines' files."""
    pipelines = []
    for name, pipeline in sorted(loaded.pipelines.items()):
        try:
            text = pipeline.path.read_text(encoding="utf-8")
        except OSError as exc:
            text = f"# cannot read {pipeline.path}: {exc}"
        pipelines.append((name, str(pipeline.path), text))
    return ConfigSource(str(loaded.path), loaded.text, pipelines, reload_status)


def managed(slots: Iterable[Slot]) -> list[ManagedEngine]:
    """The engines of this worker's own fleet (none with an engine host)."""
    engines = (slot.model.runtime.engine for slot in slots)
    return [engine for engine in engines if isinstance(engine, ManagedEngine)]


Manage = Callable[[Callable[[], Engine], Path], Engine]


def build_runtime(
    entry: ModelEntry, manage: Manage, tokenizers: dict[Path, Any], models: list[ModelEntry]
) -> Any:
    from pipeserve.engine.runtime import build_runtime as build
    from pipeserve.engine.runtime import draft_entry

    draft = draft_entry(models, entry)
    return build(entry, manage=manage, tokenizers=tokenizers, draft=draft)
