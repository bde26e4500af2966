"""Checks of `options.speculative` that need the whole config: the draft model it names,
and the combinations this version cannot run (a sharded model or draft)."""

from __future__ import annotations

from pipeserve.config.loader import YamlDoc
from pipeserve.config.models import ModelEntry, ServerConfig
from pipeserve.config.problems import PathKey, Problem

SHARDED = (
    "speculative decoding is not available for a sharded model: its ranks replay rank 0's"
    " decode steps in lockstep, and a verification step is not one of them yet"
)
SHARDED_DRAFT = "is sharded; a draft runs whole, in the engine thread of the model it drafts for"
REPLAYED_DRAFT = "is a replay model; a draft must be engine mlx"


def check_speculative(doc: YamlDoc, config: ServerConfig) -> list[Problem]:
    problems: list[Problem] = []
    by_name = {entry.name: entry for entry in config.models}
    for index, entry in enumerate(config.models):
        spec = entry.options.speculative
        if spec is None:
            continue
        at: PathKey = ("models", index, "options", "speculative")
        if entry.options.sharding is not None:
            problems.append(doc.problem(at, SHARDED))
        if spec.method == "draft":
            message = _draft_problem(entry, by_name.get(spec.draft or ""), spec.draft)
            if message is not None:
                problems.append(doc.problem(at + ("draft",), message))
    return problems


def _draft_problem(entry: ModelEntry, draft: ModelEntry | None, name: str | None) -> str | None:
    if draft is None:
        return f"draft model {name!r} is not a model of this config"
    if draft.name == entry.name:
        return "a model cannot be its own draft"
    if draft.options.sharding is not None:
        return f"draft model {name!r} {SHARDED_DRAFT}"
    if draft.engine != "mlx":
        return f"draft model {name!r} {REPLAYED_DRAFT}"
    return None
