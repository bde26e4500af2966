"""Checks of `options.speculative` that need the whole config: the draft model it names,
and the combinations this version cannot run (a sharded model; the draft method)."""

from __future__ import annotations

from pipeserve.config.loader import YamlDoc
from pipeserve.config.models import ServerConfig
from pipeserve.config.problems import PathKey, Problem

SHARDED = (
    "speculative decoding is not available for a sharded model: its ranks replay rank 0's"
    " decode steps in lockstep, and a verification step is not one of them yet"
)
DRAFT_UNAVAILABLE = (
    "method draft is not available yet (only prompt_lookup is); requests' `prediction`"
    " proposes either way"
)


def check_speculative(doc: YamlDoc, config: ServerConfig) -> list[Problem]:
    problems: list[Problem] = []
    names = {entry.name for entry in config.models}
    for index, entry in enumerate(config.models):
        spec = entry.options.speculative
        if spec is None:
            continue
        at: PathKey = ("models", index, "options", "speculative")
        if entry.options.sharding is not None:
            problems.append(doc.problem(at, SHARDED))
        if spec.method != "draft":
            continue
        if spec.draft not in names:
            message = f"draft model {spec.draft!r} is not a model of this config"
            problems.append(doc.problem(at + ("draft",), message))
        elif spec.draft == entry.name:
            problems.append(doc.problem(at + ("draft",), "a model cannot be its own draft"))
        else:
            problems.append(doc.problem(at + ("method",), DRAFT_UNAVAILABLE))
    return problems
