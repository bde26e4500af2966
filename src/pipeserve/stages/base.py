"""The stage contract and the stage registry (the per-request context is pipeserve.context).

A stage kind is registered under a short snake_case name with its parameter model
(which drives YAML validation and the JSON schema). At build time the factory gets the
validated params and a BuildEnv; per request the stage is called on an iterator of
events and returns an iterator of events (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias, TypeVar

from pydantic import BaseModel, ConfigDict

from pipeserve.context import RequestContext
from pipeserve.events import Event

if TYPE_CHECKING:
    from pipeserve.engine.base import ModelRuntime

StageRole: TypeAlias = Literal["render", "generate", "transform"]


class StageParams(BaseModel):
    """Base class of every stage's parameter model: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Stage(Protocol):
    """A built stage. `prepare` runs before the response starts (errors become 4xx)."""

    def prepare(self, ctx: RequestContext) -> None: ...

    def __call__(self, events: Iterator[Event], ctx: RequestContext) -> Iterator[Event]: ...


class StreamStage:
    """Convenience base: no prepare step; subclasses implement __call__."""

    def prepare(self, ctx: RequestContext) -> None:
        return None

    def __call__(self, events: Iterator[Event], ctx: RequestContext) -> Iterator[Event]:
        raise NotImplementedError


@dataclass(frozen=True)
class BuildEnv:
    """What a stage factory may use at build time. runtime is None when only validating."""

    model_name: str
    family: str
    runtime: ModelRuntime | None = None


P = TypeVar("P", bound=BaseModel)
StageFactory: TypeAlias = Callable[[Any, BuildEnv], Stage]


@dataclass(frozen=True)
class StageSpec:
    kind: str
    params_model: type[BaseModel]  # a StageParams, or a RootModel union (tool_calls)
    factory: StageFactory
    role: StageRole
    description: str


STAGE_REGISTRY: dict[str, StageSpec] = {}


def register_stage(
    kind: str,
    params: type[P],
    *,
    role: StageRole = "transform",
    description: str = "",
) -> Callable[[Callable[[P, BuildEnv], Stage]], Callable[[P, BuildEnv], Stage]]:
    """Register a stage factory under `kind`; YAML refers to it by that name only."""

    def decorator(factory: Callable[[P, BuildEnv], Stage]) -> Callable[[P, BuildEnv], Stage]:
        if kind in STAGE_REGISTRY:
            raise ValueError(f"stage kind {kind!r} registered twice")
        text = description or ((factory.__doc__ or "").strip().splitlines() or [""])[0]
        STAGE_REGISTRY[kind] = StageSpec(kind, params, factory, role, text)
        return factory

    return decorator


class Chain:
    """The built stages of one (endpoint, model) pair, reused by every request.

    `prepare` runs every stage's prepare step in order, except that the generate stage
    goes last: transforms may set facts it needs (e.g. an assistant prefill that forces
    a tool call), and it submits the job to the engine (unless ctx.dry_run).
    """

    def __init__(self, stages: list[Stage], roles: list[StageRole]) -> None:
        if len(stages) != len(roles):
            raise ValueError("one role per stage")
        self.stages = stages
        self.roles = roles

    def prepare(self, ctx: RequestContext) -> None:
        stages = self.used(ctx)
        for stage, role in stages:
            if role != "generate":
                stage.prepare(ctx)
        for stage, role in stages:
            if role == "generate":
                stage.prepare(ctx)

    def run(self, ctx: RequestContext) -> Iterator[Event]:
        events: Iterator[Event] = iter(())
        for stage, _ in self.used(ctx):
            events = stage(events, ctx)
        return events

    def used(self, ctx: RequestContext) -> list[tuple[Stage, StageRole]]:
        """The stages a request runs through: a raw prompt (legacy completions) is
        answered with the model's text as generated, so stages that parse the output
        (`parses_output`: reasoning, tool calls) are left out."""
        raw = ctx.request.raw_prompt is not None
        return [
            (stage, role)
            for stage, role in zip(self.stages, self.roles)
            if not (raw and getattr(stage, "parses_output", False))
        ]

    def capabilities(self) -> frozenset[str]:
        """What the stages can produce beyond text (`thinking`, `tools`), for model cards."""
        found: set[str] = set()
        for stage in self.stages:
            found |= getattr(stage, "capabilities", frozenset())
        return frozenset(found)


__all__ = [
    "STAGE_REGISTRY",
    "BuildEnv",
    "Chain",
    "RequestContext",
    "Stage",
    "StageFactory",
    "StageParams",
    "StageRole",
    "StageSpec",
    "StreamStage",
    "register_stage",
]
