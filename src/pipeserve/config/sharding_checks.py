"""Checks of `options.sharding`: the engine, the installed MLX's backends, the hosts file or the node list, and
whether the model's architecture can be sharded that way (from its config.json; a Hub
model not downloaded yet is checked when it loads).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeserve.config.loader import YamlDoc
from pipeserve.config.models import ServerConfig, ShardingOptions
from pipeserve.config.problems import PathKey, Problem
from pipeserve.engine.sharding.hostfile import read_hostfile


def check_sharding(doc: YamlDoc, config: ServerConfig) -> list[Problem]:
    """Every sharding problem of a parsed config; resolves `hostfile` against its folder."""
    problems: list[Problem] = []
    # Each sharded model has a shard host of its own (server/remote/host.py), so several
    # can be served at once and one may load on demand (its host exits when it unloads).
    sharded = [(i, m) for i, m in enumerate(config.models) if m.options.sharding is not None]
    for index, entry in sharded:
        options = entry.options.sharding
        assert options is not None
        at: PathKey = ("models", index, "options", "sharding")
        if entry.engine != "mlx":
            problems.append(doc.problem(at, f"sharding needs engine: mlx, not {entry.engine!r}"))
        problems += _check_options(doc, at, options, entry.source)
    return problems


def _check_options(
    doc: YamlDoc, at: PathKey, options: ShardingOptions, source: str
) -> list[Problem]:
    from pipeserve.engine.sharding.support import backend_problem, sharding_problems

    problems = []
    missing = backend_problem(options.backend)
    if missing:
        problems.append(doc.problem(at + ("backend",), missing))
    if options.hostfile is not None:
        path = Path(options.hostfile).expanduser()
        path = path if path.is_absolute() else doc.path.parent / path
        options.hostfile = str(path.resolve())
        hosts, message = read_hostfile(path)
        if message:
            return problems + [doc.problem(at + ("hostfile",), message)]
        if options.ranks is not None and options.ranks != len(hosts):
            message = f"ranks {options.ranks} but the hosts file lists {len(hosts)} hosts"
            return problems + [doc.problem(at + ("ranks",), message)]
        options.ranks = len(hosts)
    config = architecture_config(source)
    # nodes: auto finds its rank count at load: only whether the architecture can be
    # sharded this way at all is known now (the placement checks the rest).
    ranks = 1 if options.nodes == "auto" else options.size
    if config is not None:
        where = at + ("split",) if options.split is not None else at + ("strategy",)
        messages = sharding_problems(config, options.strategy, ranks, options.split)
        if messages and options.hostfile is not None and _fits_fewer(config, options):
            messages = []  # placed on fewer of the hosts (engine/sharding/placement.py)
        for message in messages:
            problems.append(
                doc.problem(where if "split" in message else at + ("strategy",), message)
            )
    return problems


def _fits_fewer(config: dict[str, Any], options: ShardingOptions) -> bool:
    """Some placement on 2 or more of the hosts file's machines suits the model's shapes."""
    from pipeserve.engine.sharding.support import sharding_problems

    sizes = range(2, options.size)
    return any(not sharding_problems(config, options.strategy, n, None) for n in sizes)


def architecture_config(source: str) -> dict[str, Any] | None:
    """The model's config.json when it can be known without downloading or building it."""
    if source.startswith("demo:"):
        from pipeserve.engine.weights.demo.families import FAMILIES

        family = FAMILIES.get(source.removeprefix("demo:").strip())
        return dict(family.config) if family else None
    path = Path(source).expanduser() / "config.json"
    if path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None
    return None
