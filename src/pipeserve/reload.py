"""Live reload: SIGHUP to the gunicorn master re-reads and re-validates the config.

gunicorn's own HUP replaces every worker with one that re-reads the files, so a broken
YAML made the new workers fail to boot and gunicorn shut the whole server down. Here the
master validates first (validation only: no MLX runs in the master, see serving.py) and
keeps serving the old config when the new one is invalid, logging each positioned
problem. A valid config is fetched (new sources, in a spawned child), its `pipeline: auto`
entries are resolved, and it is handed to the workers as a pickled snapshot; each worker
applies it in place (pipeserve.live_app): unchanged models keep their weights,
streams in progress finish on the objects they started with. Workers forked later (a
replaced worker) start from the master's last valid config, never from the file.
"""

from __future__ import annotations

import atexit
import os
import pickle
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any

from gunicorn.arbiter import Arbiter

RESTART_ONLY = ("host", "port", "workers")


class Snapshot:
    """The last valid config, as a file only this user can read, for workers to load;
    sealed with the server's secret (server/remote/wire.py), which the forked workers
    inherit and the engine and shard hosts get on their stdin."""

    def __init__(self) -> None:
        from pipeserve.server.remote.wire import new_secret

        self.secret = new_secret()
        self.folder = Path(tempfile.mkdtemp(prefix="pipeserve-config-"))
        self.path = self.folder / "config.pickle"
        self.reload_status = self.folder / "reload-status.json"  # read by the console
        owner = os.getpid()

        def remove_in_owner() -> None:
            if os.getpid() == owner:
                shutil.rmtree(self.folder, True)

        atexit.register(remove_in_owner)

    def write(self, loaded: Any) -> None:
        from pipeserve.server.remote.wire import write_sealed

        write_sealed(self.path, loaded, self.secret)

    def read(self) -> Any:
        from pipeserve.server.remote.wire import read_sealed

        return read_sealed(self.path, self.secret)


class ReloadingArbiter(Arbiter):  # type: ignore[misc]
    """gunicorn's master, with HUP meaning: validate, then reload the workers in place."""

    def handle_hup(self) -> None:
        app = self.app
        self.log.info("Hang up: re-reading %s", app.config_path)
        try:
            loaded = reread(app, self.log)
            if loaded is None:
                return
            app.snapshot.write(loaded)
        except Exception:  # whatever goes wrong, a reload must not stop the master
            self.log.exception("reload failed; the running config keeps serving")
            return
        from pipeserve.engine.weights.loader import forget_preloaded_tokenizers

        app.loaded = loaded
        forget_preloaded_tokenizers()  # a worker forked from now on reads the folders
        if app.host is not None:  # first the engines, so workers find the new models there
            app.host.reload()
        for pid in list(self.WORKERS):
            try:
                os.kill(pid, signal.SIGHUP)
            except ProcessLookupError:  # exited meanwhile; its replacement forks the new config
                pass
        self.log.info("config %s is valid; workers reload it in place", app.config_path)

    def manage_workers(self) -> None:
        super().manage_workers()
        for host in self.app.all_hosts():  # runs on every turn of the master's loop
            host.check()

    def stop(self, graceful: bool = True) -> None:
        super().stop(graceful)
        for host in self.app.all_hosts():  # after the workers: their last requests need them
            host.stop()


def reread(app: Any, log: Any) -> Any:
    """The new config, validated, fetched and resolved; None (logged) when it is unusable."""
    from pipeserve.config import ConfigError, load_server_config
    from pipeserve.config.auto import resolve_auto
    from pipeserve.prefetch import fetch_sources

    def refuse(problems: list[Any], why: str) -> None:
        for problem in problems:
            log.error("%s", problem)
        log.error("reload refused: %s; the running config keeps serving", why)
        record_reload(app, problems or [why])

    try:
        loaded = load_server_config(app.config_path)
    except ConfigError as error:
        refuse(error.problems, f"{app.config_path} is invalid")
        return None
    folders = fetch_sources(loaded.config, known=app.folders)
    if folders is None:
        refuse([], "a model source could not be fetched (see the log)")
        return None
    try:
        loaded = resolve_auto(loaded, folders)
    except ConfigError as error:
        refuse(error.problems, "no pipeline fits a `pipeline: auto` model")
        return None
    app.folders.update({e.source: folders[e.name] for e in loaded.config.models})
    warn_restart_only(app.loaded, loaded, log)
    record_reload(app, [])
    return loaded


def record_reload(app: Any, problems: list[Any]) -> None:
    """For the console's Config view: the last reload's outcome, beside the snapshot."""
    from pipeserve.server.console.config_view import write_reload_status

    try:
        write_reload_status(app.snapshot.reload_status, str(app.config_path), problems)
    except OSError:  # the console then shows no reload; serving is unaffected
        pass


def warn_restart_only(old: Any, new: Any, log: Any) -> None:
    for key in RESTART_ONLY:
        before, after = getattr(old.config.server, key), getattr(new.config.server, key)
        if before != after:
            log.warning("server.%s changed (%s -> %s): takes effect at restart", key, before, after)


def reload_worker(app: Any, wsgi: Any, log: Any) -> None:
    """In a worker, on SIGHUP from the master: apply the master's snapshot in place."""
    try:
        loaded = app.snapshot.read()
    except (OSError, ValueError, pickle.UnpicklingError, AttributeError) as exc:
        log.error("reload: cannot read the master's config snapshot: %s", exc)
        return
    if wsgi.reload(loaded):
        log.info("worker %d: reloaded %s", os.getpid(), app.config_path)
