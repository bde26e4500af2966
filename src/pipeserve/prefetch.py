"""Model sources fetched before gunicorn forks its workers (at start and at a reload)."""

from __future__ import annotations

import logging
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

log = logging.getLogger("pipeserve.serving")  # the start-up log it has always been part of


def fetch_sources(config: Any, known: dict[str, Path] | None = None) -> dict[str, Path] | None:
    """Build demo models and download hub models once, before forking: a worker that
    spends minutes downloading would be killed by gunicorn's timeout. Returns each model's
    folder (None after reporting a failure); `known` (source -> folder) are not fetched again.

    It runs in a spawned child, never in the master: building a demo model runs MLX, and
    MLX's stream threads do not survive gunicorn's fork (a worker forked from a master
    that ran MLX hung at its first `mx.clear_cache`, waiting on a thread it does not have).
    """
    known = known or {}
    folders = {e.name: known[e.source] for e in config.models if e.source in known}
    missing = [e for e in config.models if e.source not in known]
    if not missing:
        return folders
    from pipeserve.engine.weights.loader import resolve_source

    with ProcessPoolExecutor(
        max_workers=1, mp_context=multiprocessing.get_context("spawn")
    ) as child:
        for entry in missing:
            try:
                path = child.submit(resolve_source, entry.source, entry.sha256).result()
            except Exception as exc:  # report every kind of failure plainly, then refuse to start
                message = f"pipeserve: model {entry.name!r}: cannot get {entry.source!r}: {exc}"
                print(message, file=sys.stderr)
                log.error("%s", message)
                return None
            log.info("model %s: source %s is at %s", entry.name, entry.source, path)
            folders[entry.name] = path
    return folders
