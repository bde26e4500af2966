"""Checks of one pipeline file: its stages, their params and their roles.

`check_pipeline` returns a LoadedPipeline (the validated stages, ready to build) or every
problem found; `stage_registry` imports the built-in stage modules and returns the kinds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from pipeserve.config.detect_rules import DetectSection
from pipeserve.config.loader import YamlDoc
from pipeserve.config.models import PipelineFile
from pipeserve.config.problems import PathKey, Problem, pydantic_problems, suggestion
from pipeserve.stages.base import STAGE_REGISTRY, StageRole, StageSpec
from pipeserve.stages.embedding.base import EmbedStageSpec

EMBED_KINDS = ("embedding", "rerank")  # pipelines of these kinds hold embedding stages
AnySpec = StageSpec | EmbedStageSpec


@dataclass(frozen=True)
class StageEntry:
    """One validated stage of a pipeline: build it with spec.factory(params, env)."""

    kind: str
    params: BaseModel
    role: StageRole
    spec: AnySpec


@dataclass(frozen=True)
class LoadedPipeline:
    name: str  # the file stem, as models refer to it
    path: Path
    family: str
    description: str
    stages: tuple[StageEntry, ...]
    detect: DetectSection | None = None
    kind: str = "generation"  # generation, or embedding / rerank (stages/embedding/)


def stage_registry() -> Mapping[str, StageSpec]:
    """The registered stage kinds; built-in modules that do not exist (yet) are skipped."""
    import importlib

    from pipeserve.stages import STAGE_MODULES

    for module in STAGE_MODULES:
        name = f"pipeserve.stages.{module}"
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
    return STAGE_REGISTRY


def embed_stage_registry() -> Mapping[str, EmbedStageSpec]:
    """The embedding stage kinds (an embedding or rerank pipeline's)."""
    from pipeserve.stages.embedding import load_embed_stages

    return load_embed_stages()


def check_pipeline(
    doc: YamlDoc, registry: Mapping[str, StageSpec]
) -> tuple[LoadedPipeline | None, list[Problem]]:
    if not isinstance(doc.data, dict):
        return None, [doc.problem((), "a pipeline file is a mapping with 'family' and 'stages'")]
    problems: list[Problem] = []
    parsed: PipelineFile | None = None
    try:
        parsed = PipelineFile.model_validate(doc.data)
    except ValidationError as exc:
        # Stage items get their own, more precise checks below.
        own = [
            p for p in pydantic_problems(doc, exc, PipelineFile) if not p.path.startswith("stages[")
        ]
        problems += own
    items = doc.data.get("stages")
    stages: list[StageEntry | None] = []
    embedding = doc.data.get("kind") in EMBED_KINDS
    kinds: Mapping[str, AnySpec] = embed_stage_registry() if embedding else registry
    if isinstance(items, list):
        specs = [_check_stage(doc, i, item, kinds, problems) for i, item in enumerate(items)]
        stages = [entry for _, entry in specs]
        if not embedding:
            problems += _check_roles(doc, [spec for spec, _ in specs])
    if problems or parsed is None:
        return None, problems
    pipeline = LoadedPipeline(
        name=doc.path.stem,
        path=doc.path,
        family=parsed.family,
        description=parsed.description,
        stages=tuple(s for s in stages if s is not None),
        detect=parsed.detect,
        kind=parsed.kind,
    )
    return pipeline, []


def _check_stage(
    doc: YamlDoc, index: int, item: Any, registry: Mapping[str, AnySpec], problems: list[Problem]
) -> tuple[AnySpec | None, StageEntry | None]:
    """The stage's spec (None: unknown or malformed) and its validated entry (None: invalid)."""
    path: PathKey = ("stages", index)
    if not isinstance(item, dict) or len(item) != 1:
        got = f"{len(item)} keys" if isinstance(item, dict) else repr(item)
        hint = f" (write '- {item}: {{}}')" if isinstance(item, str) and item in registry else ""
        problems.append(
            doc.problem(
                path, f"a stage is a single-key mapping {{kind: {{params}}}}, got {got}{hint}"
            )
        )
        return None, None
    kind, params = next(iter(item.items()))
    spec = registry.get(kind)
    if spec is None:
        message = f"unknown stage kind {kind!r}{suggestion(kind, registry)}"
        problems.append(doc.problem(path + (kind,), message, prefer_key=True))
        return None, None
    if params is None:
        params = {}
    if not isinstance(params, dict):
        message = f"the parameters of stage {kind!r} must be a mapping (or empty), got {params!r}"
        problems.append(doc.problem(path + (kind,), message))
        return spec, None
    try:
        validated = spec.params_model.model_validate(params)
    except ValidationError as exc:
        problems += pydantic_problems(doc, exc, spec.params_model, path + (kind,))
        return spec, None
    return spec, StageEntry(kind, validated, spec.role, spec)


def _check_roles(doc: YamlDoc, specs: list[AnySpec | None]) -> list[Problem]:
    problems = []
    generate = [i for i, s in enumerate(specs) if s is not None and s.role == "generate"]
    render = [i for i, s in enumerate(specs) if s is not None and s.role == "render"]
    if specs and not generate and all(s is not None for s in specs):  # else: reported already
        message = "the pipeline needs exactly one generation stage (e.g. '- generate: {}')"
        problems.append(doc.problem(("stages",), message, prefer_key=True))
    for i in generate[1:]:
        message = f"a second generation stage (the first is stages[{generate[0]}]); exactly one is allowed"
        problems.append(doc.problem(_stage_key(specs, i), message, prefer_key=True))
    for i in render[1:]:
        message = (
            f"a second render stage (the first is stages[{render[0]}]); at most one is allowed"
        )
        problems.append(doc.problem(_stage_key(specs, i), message, prefer_key=True))
    if render and generate and render[0] > generate[0]:
        message = f"the render stage must come before the generation stage (stages[{generate[0]}])"
        problems.append(doc.problem(_stage_key(specs, render[0]), message, prefer_key=True))
    return problems


def _stage_key(specs: list[AnySpec | None], index: int) -> PathKey:
    spec = specs[index]
    return ("stages", index, spec.kind) if spec else ("stages", index)
