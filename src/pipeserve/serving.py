"""`pipeserve serve`: gunicorn with gevent workers, started programmatically.

The master validates the config (refusing to start on any error), checks the MLX
backend, sets up OpenBLAS (CPU backend) or the kernel cache (CUDA backend) and forks
workers; each worker, after gevent's monkey patching, loads its models (one engine OS
thread per model) and builds the Falcon app.
"""

from __future__ import annotations

import logging
import logging.config
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from gunicorn.app.base import BaseApplication

from pipeserve import backend, blas
from pipeserve.logs import logging_config
from pipeserve.prefetch import fetch_sources
from pipeserve.settings import Settings, pipeserve_home

log = logging.getLogger("pipeserve.serving")


class PipeserveApplication(BaseApplication):  # type: ignore[misc]
    def __init__(
        self, config_path: Path, options: dict[str, Any], api_keys: list[str], loaded: Any = None
    ) -> None:
        self.config_path = config_path
        self.options = options
        self.api_keys = api_keys
        # The validated config with `pipeline: auto` resolved, made in the master; forked
        # workers build from it instead of re-reading a file that may have changed since.
        self.loaded = loaded
        self.folders: dict[str, Path] = {}  # source -> fetched folder, for reloads
        # server.workers > 1: the engine host that runs each model once for all workers
        self.host: Any = None
        # each sharded model's own shard host (host.py --only), by model name
        self.shard_hosts: dict[str, Any] = {}
        self.host_logs = ("human", "info")  # (format, level) for the host's log lines
        super().__init__()

    def run(self) -> None:
        from pipeserve.reload import ReloadingArbiter, Snapshot

        self.snapshot = Snapshot()  # the last valid config, for workers told to reload
        if int(self.cfg.workers or 1) > 1:
            self.start_engine_host()
        self.start_shard_hosts()
        import_the_server()  # before the bind: each forked worker accepts at once
        self.preload_tokenizers()
        try:
            ReloadingArbiter(self).run()
        except RuntimeError as e:  # as gunicorn's BaseApplication.run
            print(f"\nError: {e}\n", file=sys.stderr)
            sys.exit(1)

    def preload_tokenizers(self) -> None:
        """The startup chat models' tokenizers, loaded before the fork and shared with
        the workers (engine/weights/loader.py preload_tokenizers: parsing one holds the
        GIL, which would freeze a booting worker's /health answers)."""
        from pipeserve.engine.weights.loader import preload_tokenizers

        models = self.loaded.config.models if self.loaded is not None else []
        folders = {
            self.folders[e.source]
            for e in models
            if e.kind == "generation" and e.engine == "mlx" and e.load == "startup"
            and e.chat_template is None and e.source in self.folders
        }  # fmt: skip
        started = time.monotonic()
        preload_tokenizers(folders)
        log.info("tokenizers preloaded for the workers in %.1f s", time.monotonic() - started)

    def start_engine_host(self) -> None:
        """Start the engine host and wait until its startup models are loaded; a host
        that cannot load them stops the start, as a worker failing to boot would."""
        from pipeserve.server.remote.supervisor import EngineHostProcess

        self.snapshot.write(self.loaded)
        self.host = EngineHostProcess(
            self.snapshot.path,
            self.snapshot.folder / "engines.sock",
            *self.host_logs,
            secret=self.snapshot.secret,
        )
        self.host.start()
        import_the_server()  # while the host loads its models
        if not self.host.wait_ready():
            self.host.stop()
            print("\nError: the engine host failed to load the models (see above)\n",
                  file=sys.stderr)  # fmt: skip
            sys.exit(1)

    def start_shard_hosts(self) -> None:
        """Each sharded model runs in a process of its own, which places it on its machines
        in the background (retrying), so that losing its group ends that process alone."""
        from pipeserve.server.remote.supervisor import EngineHostProcess

        models = self.loaded.config.models if self.loaded is not None else []
        sharded = [e.name for e in models if e.options.sharding is not None]
        if not sharded:
            return
        self.snapshot.write(self.loaded)
        for number, name in enumerate(sharded):
            socket_path = self.snapshot.folder / f"shard-{number}.sock"
            host = EngineHostProcess(
                self.snapshot.path,
                socket_path,
                *self.host_logs,
                only=name,
                secret=self.snapshot.secret,
            )
            host.start()
            self.shard_hosts[name] = host
        import_the_server()  # while the hosts start
        for host in self.shard_hosts.values():
            host.wait_ready()  # listening (its model is placed in the background)

    def all_hosts(self) -> list[Any]:
        """The engine and shard host processes the master supervises."""
        return ([self.host] if self.host is not None else []) + list(self.shard_hosts.values())

    def reload_worker(self, wsgi: Any, worker_log: Any) -> None:
        """In a worker told by the master (SIGHUP) that a new config is valid: apply it."""
        from pipeserve.reload import reload_worker

        reload_worker(self, wsgi, worker_log)

    def load_config(self) -> None:
        for key, value in self.options.items():
            self.cfg.set(key, value)

    def load(self) -> Any:
        """The worker's app: at once one that answers /health and /v1/models "starting"
        (server/booting.py); the worker builds the real one in the background (build)."""
        from pipeserve.server.booting import BootingApp

        models = self.loaded.config.models if self.loaded is not None else []
        return BootingApp([e.name for e in models], self.build, import_the_server)

    def build(self) -> Any:
        from pipeserve.loading import build_app_from_config, build_app_from_loaded

        if backend.cpu_backend():
            in_use = blas.loaded_blas()
            log.info("worker %d: BLAS in use: %s", os.getpid(), in_use)
            if os.environ.get(blas.MARKER) and in_use != "openblas":
                log.warning("OpenBLAS was preloaded but is not mapped in this worker; slow matmuls")
        if self.loaded is not None:
            workers = int(self.cfg.workers or 1)
            host = self.host.socket_path if self.host is not None else None
            shards = {name: h.socket_path for name, h in self.shard_hosts.items()}
            return build_app_from_loaded(
                self.loaded,
                api_keys=self.api_keys,
                workers=workers,
                engine_host=host,
                reload_status=self.snapshot.reload_status,
                shard_hosts=shards,
                host_secret=self.snapshot.secret,
            )
        return build_app_from_config(self.config_path, api_keys=self.api_keys)


def import_the_server() -> None:
    """What a worker needs before it builds its app (MLX, the tokenizer libraries,
    Falcon, the stages): seconds of imports. The master imports them before it binds the
    port, so that a forked worker has them already and accepts within milliseconds of
    its fork (its `/health` answers "starting": server/booting.py); a worker that
    imported them itself left every request of its first seconds unanswered in the
    listen queue (0.9-2.5 s after the bind, one or two workers).

    Fork-safe: none of these modules starts a thread or runs an MLX op at import (MLX
    creates its streams' threads on first use, in the worker); locks they create at
    import are plain ones, never held across a greenlet switch. psycopg stays out of the
    master (it picks its wait functions at import: see check_response_store)."""
    if "pipeserve.loading" in sys.modules:
        return
    started = time.monotonic()
    import pipeserve.loading  # noqa: F401
    from pipeserve.api import load_builtin_protocols
    from pipeserve.stages import load_builtin_stages
    from pipeserve.stages.embedding import load_embed_stages
    from pipeserve.stages.toolfmt.registry import load_builtin_formats

    # the plug-in registries import their modules lazily: on a worker's hub otherwise
    load_builtin_protocols()
    load_builtin_stages()
    load_embed_stages()
    load_builtin_formats()

    log.info("server modules imported in %.1f s", time.monotonic() - started)


def gunicorn_options(
    config: Any, host: str, port: int, workers: int, log_level: str
) -> dict[str, Any]:
    server = config.server
    return {
        "bind": f"{host}:{port}",
        "workers": workers,
        # gunicorn's gevent worker, minus the wait for idle keep-alive connections at stop.
        "worker_class": "pipeserve.server.worker.PipeserveWorker",
        "worker_connections": 1000,
        # The engine runs on its own OS thread, so the hub keeps beating during decode;
        # the timeout still bounds a wedged worker. Model loading happens before it counts.
        "timeout": 300,
        "graceful_timeout": int(server.graceful_timeout),
        "keepalive": 75,
        "loglevel": log_level,
        # One format for every line (server.log_format); the request log replaces the
        # access log (pipeserve.logs).
        "logconfig_dict": logging_config(server.log_format, log_level),
        "accesslog": None,
        "errorlog": "-",
        "limit_request_line": 8190,
        # gunicorn's pure-Python parser rescans the whole header block on every 8 KB read,
        # so its cost grows with the square of the block (fields x field size): at
        # 100 x 64 KB one hostile client held the hub for 6.6 s. 64 x 8 KB bounds that to
        # tens of ms; longer mock completions go in the body's `mock_response`.
        "limit_request_fields": 64,
        "limit_request_field_size": 8190,
        "proc_name": "pipeserve",
        **without_control_socket(),
    }


def without_control_socket() -> dict[str, Any]:
    """gunicorn >= 27 opens a control socket at one fixed path in $HOME, shared by every
    server of the user (a second server takes it over, and an unwritable HOME logs an
    ERROR at each start); pipeserve is managed by signals (SIGHUP reload), so none."""
    from gunicorn.config import Config

    return {"control_socket_disable": True} if "control_socket_disable" in Config().settings else {}


def serve(
    config_path: Path | str | None = None,
    host: str | None = None,
    port: int | None = None,
    workers: int | None = None,
) -> int:
    """Validate the config, prepare BLAS, and run gunicorn until stopped."""
    from pipeserve.config import ConfigError, load_server_config
    from pipeserve.config.auto import resolve_auto

    settings = Settings()
    path = Path(config_path) if config_path else settings.config
    try:
        loaded = load_server_config(path)
    except ConfigError as error:
        print(str(error), file=sys.stderr)
        print(f"pipeserve: refusing to start: {path} is invalid", file=sys.stderr)
        return 1
    config = loaded.config
    problem = backend.install_problem()
    if problem:
        print(f"pipeserve: refusing to start: {problem}", file=sys.stderr)
        return 1
    home = settings.home.expanduser() if settings.home else pipeserve_home()
    cpu = backend.cpu_backend()
    not_used = blas.reexec_with_openblas(settings.blas, home) if cpu else None
    log_level = settings.log_level or config.server.log_level
    logging.config.dictConfig(logging_config(config.server.log_format, log_level))
    log.info("MLX backend: %s", ", ".join(backend.installed_backends()) or "mlx (bundled)")
    if cpu:
        log.info("BLAS: %s", describe_blas(not_used))
    kernels = backend.keep_kernel_cache(home)
    if kernels is not None:
        log.info("MLX kernel cache: %s", kernels)
    if not check_response_store(config, path.parent):
        return 1
    folders = fetch_sources(config)
    if folders is None:
        return 1
    try:
        loaded = resolve_auto(loaded, folders)
    except ConfigError as error:
        print(str(error), file=sys.stderr)
        return 1
    worker_count = workers or settings.workers or config.server.workers
    options = gunicorn_options(
        config,
        host or settings.host or config.server.host,
        port
        if port is not None
        else (settings.port if settings.port is not None else config.server.port),
        worker_count,
        log_level,
    )
    application = PipeserveApplication(path, options, settings.env_api_keys(), loaded)
    application.folders = {e.source: folders[e.name] for e in config.models}
    application.host_logs = (config.server.log_format, log_level)
    application.run()
    return 0


def check_response_store(config: Any, config_dir: Path) -> bool:
    """Create, migrate or check the response store before forking, so that a corrupt,
    unwritable or too new one stops the start with a clear message instead of failing
    every worker. A PostgreSQL store that cannot be reached now does not stop it.

    PostgreSQL is checked in a spawned child: psycopg picks its wait functions when first
    imported, and imported in the master it would block the workers' gevent hubs."""
    from pipeserve.store import check_store

    options = config.server.responses_store
    if options is not False and options.url is not None:
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as child:
            checked = child.submit(check_store, config.server, config_dir).result()
    else:
        checked = check_store(config.server, config_dir)
    if checked is None:
        return True
    if checked.problem is not None:
        fix = (
            "Fix the database, point server.responses_store.url at another"
            if options.url is not None
            else "Fix or remove the file, set server.responses_store.path elsewhere"
        )
        print(
            f"pipeserve: the response store {checked.where} cannot be used: {checked.problem}."
            f" {fix}, or set server.responses_store: false.",
            file=sys.stderr,
        )
        return False
    if checked.unreachable is not None:
        log.warning(
            "the response store cannot be reached now (%s): starting anyway; requests that"
            " need it get a 503 until it is back",
            checked.unreachable,
        )
    else:
        log.info("responses are stored in %s", checked.where)
    return True


def describe_blas(not_used: str | None) -> str:
    if not_used is None:
        return f"OpenBLAS preloaded from {blas.find_openblas()} (PIPESERVE_BLAS=off to use the bundled one)"
    return f"MLX's bundled single-threaded reference BLAS: {not_used}"
