"""Stage kinds: `load_builtin_stages()` imports the built-in stage modules, which register
themselves (importing this package alone registers nothing). See docs/extending.md."""

from __future__ import annotations

import importlib

from pipeserve.context import RequestContext
from pipeserve.stages.base import (
    STAGE_REGISTRY,
    BuildEnv,
    Chain,
    Stage,
    StageParams,
    StageSpec,
    StreamStage,
    register_stage,
)

# One module per stage kind; each registers itself on import.
STAGE_MODULES: tuple[str, ...] = (
    "render_template",
    "generate",
    "thinking",
    "tool_calls",
    "stop_sequences",
)


def load_builtin_stages() -> dict[str, StageSpec]:
    for module in STAGE_MODULES:
        importlib.import_module(f"pipeserve.stages.{module}")
    return STAGE_REGISTRY


__all__ = [
    "STAGE_MODULES",
    "STAGE_REGISTRY",
    "BuildEnv",
    "Chain",
    "RequestContext",
    "Stage",
    "StageParams",
    "StageSpec",
    "StreamStage",
    "load_builtin_stages",
    "register_stage",
]
