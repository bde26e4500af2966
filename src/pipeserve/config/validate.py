"""Validation of server configs and pipeline files, with positions and cross-file checks.

The server calls `load_server_config(path)`; `pipeserve validate` calls `validate_paths`.
Both collect every problem of a run and raise/return them together.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from pipeserve.config.loader import (
    ConfigError,
    PathKey,
    Problem,
    YamlDoc,
    display_path,
    dotted,
    load_yaml,
    pydantic_problems,
    suggestion,
)
from pipeserve.config.models import ModelEntry, PipelineFile, ServerConfig
from pipeserve.stages.base import STAGE_REGISTRY, StageParams, StageRole, StageSpec

# Mirrors pipeserve.api's protocol names (a test keeps them equal); a constant here so
# validation does not import the protocol modules.
KNOWN_APIS: tuple[str, ...] = ("openai-chat", "anthropic-messages", "openai-responses")
YAML_SUFFIXES: tuple[str, ...] = (".yaml", ".yml")

FileKind = Literal["config", "pipeline"]


@dataclass(frozen=True)
class StageEntry:
    """One validated stage of a pipeline: build it with spec.factory(params, env)."""

    kind: str
    params: StageParams
    role: StageRole
    spec: StageSpec


@dataclass(frozen=True)
class LoadedPipeline:
    name: str  # the file stem, as models refer to it
    path: Path
    family: str
    description: str
    stages: tuple[StageEntry, ...]


@dataclass(frozen=True)
class LoadedConfig:
    """A validated server config plus every pipeline its models use (by name)."""

    path: Path
    config: ServerConfig
    pipelines: dict[str, LoadedPipeline]

    def pipeline_for(self, model: ModelEntry | str) -> LoadedPipeline:
        entry = model if isinstance(model, ModelEntry) else self.model(model)
        return self.pipelines[entry.pipeline]

    def model(self, name: str) -> ModelEntry:
        for entry in self.config.models:
            if entry.name == name:
                return entry
        raise KeyError(name)


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


def detect_kind(doc: YamlDoc) -> FileKind | None:
    """Pipeline or server config, by its keys first, then by its folder's name."""
    keys = set(doc.data) if isinstance(doc.data, dict) else set()
    pipeline = bool(keys & {"stages", "family"})
    config = bool(keys & {"models", "endpoints", "server", "pipelines_dir"})
    if pipeline != config:
        return "pipeline" if pipeline else "config"
    folder = doc.path.resolve().parent.name
    if folder == "pipelines":
        return "pipeline"
    if folder == "configs":
        return "config"
    return None


Checked = tuple[Any, list[Problem]]  # (LoadedPipeline | LoadedConfig | None, problems)


class Validator:
    """Validates files once each per run (a pipeline used by several configs is checked once)."""

    def __init__(self, registry: Mapping[str, StageSpec] | None = None) -> None:
        self.registry = registry if registry is not None else stage_registry()
        self._pipelines: dict[Path, Checked] = {}
        self._configs: dict[Path, Checked] = {}

    def file(self, path: Path) -> list[Problem]:
        """Every problem of one file of either kind (and of the pipelines a config uses)."""
        try:
            doc = load_yaml(path)
        except ConfigError as exc:
            return exc.problems
        kind = detect_kind(doc)
        if kind == "pipeline":
            return self.pipeline(path, doc)[1]
        if kind == "config":
            return self.config(path, doc)[1]
        message = "cannot tell a server config (models, endpoints) from a pipeline (family, stages)"
        return [doc.problem((), message)]

    def pipeline(self, path: Path, doc: YamlDoc | None = None) -> tuple[LoadedPipeline | None, list[Problem]]:
        return self._cached(self._pipelines, path, doc, lambda d: check_pipeline(d, self.registry))

    def config(self, path: Path, doc: YamlDoc | None = None) -> tuple[LoadedConfig | None, list[Problem]]:
        return self._cached(self._configs, path, doc, lambda d: check_config(d, self))

    @staticmethod
    def _cached(
        cache: dict[Path, Checked], path: Path, doc: YamlDoc | None, check: Callable[[YamlDoc], Checked]
    ) -> Checked:
        key = path.resolve()
        if key not in cache:
            try:
                cache[key] = check(doc or load_yaml(path))
            except ConfigError as exc:  # unreadable or not YAML
                cache[key] = (None, exc.problems)
        return cache[key]


# --- pipelines -----------------------------------------------------------------------


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
        own = [p for p in pydantic_problems(doc, exc, PipelineFile) if not p.path.startswith("stages[")]
        problems += own
    items = doc.data.get("stages")
    stages: list[StageEntry | None] = []
    if isinstance(items, list):
        specs = [_check_stage(doc, i, item, registry, problems) for i, item in enumerate(items)]
        stages = [entry for _, entry in specs]
        problems += _check_roles(doc, [spec for spec, _ in specs])
    if problems or parsed is None:
        return None, problems
    pipeline = LoadedPipeline(
        name=doc.path.stem,
        path=doc.path,
        family=parsed.family,
        description=parsed.description,
        stages=tuple(s for s in stages if s is not None),
    )
    return pipeline, []


def _check_stage(
    doc: YamlDoc, index: int, item: Any, registry: Mapping[str, StageSpec], problems: list[Problem]
) -> tuple[StageSpec | None, StageEntry | None]:
    """The stage's spec (None: unknown or malformed) and its validated entry (None: invalid)."""
    path: PathKey = ("stages", index)
    if not isinstance(item, dict) or len(item) != 1:
        got = f"{len(item)} keys" if isinstance(item, dict) else repr(item)
        hint = f" (write '- {item}: {{}}')" if isinstance(item, str) and item in registry else ""
        problems.append(doc.problem(path, f"a stage is a single-key mapping {{kind: {{params}}}}, got {got}{hint}"))
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


def _check_roles(doc: YamlDoc, specs: list[StageSpec | None]) -> list[Problem]:
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
        message = f"a second render stage (the first is stages[{render[0]}]); at most one is allowed"
        problems.append(doc.problem(_stage_key(specs, i), message, prefer_key=True))
    if render and generate and render[0] > generate[0]:
        message = f"the render stage must come before the generation stage (stages[{generate[0]}])"
        problems.append(doc.problem(_stage_key(specs, render[0]), message, prefer_key=True))
    return problems


def _stage_key(specs: list[StageSpec | None], index: int) -> PathKey:
    spec = specs[index]
    return ("stages", index, spec.kind) if spec else ("stages", index)


# --- server configs ------------------------------------------------------------------


def check_config(doc: YamlDoc, validator: Validator) -> tuple[LoadedConfig | None, list[Problem]]:
    if not isinstance(doc.data, dict):
        return None, [doc.problem((), "a server config is a mapping with 'models' and 'endpoints'")]
    problems: list[Problem] = []
    parsed: ServerConfig | None = None
    try:
        parsed = ServerConfig.model_validate(doc.data)
    except ValidationError as exc:
        problems += pydantic_problems(doc, exc, ServerConfig)
    models = _entries(doc.data.get("models"))
    endpoints = _entries(doc.data.get("endpoints"))
    problems += _unique(doc, "models", models, "name", "model name")
    problems += _unique(doc, "endpoints", endpoints, "route", "route", normalize=_route_key)
    problems += _check_endpoints(doc, endpoints, {m.get("name") for _, m in models})
    pipelines, pipeline_problems = _check_model_pipelines(doc, models, validator)
    problems += pipeline_problems
    if problems or parsed is None:
        return None, problems
    return LoadedConfig(doc.path, parsed, pipelines), []


def _entries(value: Any) -> list[tuple[int, dict[str, Any]]]:
    if not isinstance(value, list):
        return []
    return [(i, item) for i, item in enumerate(value) if isinstance(item, dict)]


def _route_key(value: str) -> str:
    return value.rstrip("/") or "/"


def _unique(
    doc: YamlDoc,
    section: str,
    entries: list[tuple[int, dict[str, Any]]],
    key: str,
    what: str,
    normalize: Callable[[str], str] = str,
) -> list[Problem]:
    problems = []
    first: dict[str, int] = {}
    for i, entry in entries:
        value = entry.get(key)
        if not isinstance(value, str):
            continue
        norm = normalize(value)
        if norm in first:
            other: PathKey = (section, first[norm], key)
            line, _ = doc.position(other)
            message = f"duplicate {what} {value!r} (also {dotted(other)} at line {line})"
            problems.append(doc.problem((section, i, key), message))
        else:
            first[norm] = i
    return problems


def _check_endpoints(
    doc: YamlDoc, endpoints: list[tuple[int, dict[str, Any]]], model_names: set[Any]
) -> list[Problem]:
    problems = []
    names = {n for n in model_names if isinstance(n, str)}
    for i, endpoint in endpoints:
        api = endpoint.get("api")
        if isinstance(api, str) and api not in KNOWN_APIS:
            message = f"unknown api {api!r}{suggestion(api, KNOWN_APIS)}"
            problems.append(doc.problem(("endpoints", i, "api"), message))
        restrict = endpoint.get("models")
        for j, name in enumerate(restrict if isinstance(restrict, list) else []):
            if isinstance(name, str) and name not in names:
                message = f"no model named {name!r}{suggestion(name, names)}"
                problems.append(doc.problem(("endpoints", i, "models", j), message))
    return problems


def _check_model_pipelines(
    doc: YamlDoc, models: list[tuple[int, dict[str, Any]]], validator: Validator
) -> tuple[dict[str, LoadedPipeline], list[Problem]]:
    problems: list[Problem] = []
    pipelines: dict[str, LoadedPipeline] = {}
    folder_value = doc.data.get("pipelines_dir", "../pipelines")
    if not isinstance(folder_value, str):
        return pipelines, problems  # pydantic reported the type
    folder = doc.path.parent / folder_value
    if not folder.is_dir() and "pipelines_dir" in doc.data:
        return pipelines, [doc.problem(("pipelines_dir",), f"no such folder: {display_path(folder)}")]
    available = _pipeline_files(folder)
    for i, model in models:
        name = model.get("pipeline")
        if not isinstance(name, str) or not name:
            continue
        path = available.get(name)
        if path is None:
            message = f"no pipeline {name!r} in {display_path(folder)}{suggestion(name, available)}"
            problems.append(doc.problem(("models", i, "pipeline"), message))
            continue
        loaded, file_problems = validator.pipeline(path)
        problems += [p for p in file_problems if p not in problems]
        if loaded is not None:
            pipelines[name] = loaded
            problems += _check_demo_family(doc, i, model, loaded)
    return pipelines, problems


def _pipeline_files(folder: Path) -> dict[str, Path]:
    if not folder.is_dir():
        return {}
    return {p.stem: p for p in sorted(folder.iterdir()) if p.suffix in YAML_SUFFIXES and p.is_file()}


def _norm(name: str) -> str:
    return name.lower().replace("-", "_")


def _check_demo_family(doc: YamlDoc, index: int, model: dict[str, Any], pipeline: LoadedPipeline) -> list[Problem]:
    """`source: demo:<family>` builds a model whose chat format is that family's."""
    source = model.get("source")
    if not isinstance(source, str) or not source.startswith("demo:"):
        return []
    family = source.removeprefix("demo:")
    known = _demo_families()
    if known and family not in known:
        message = f"unknown demo model {source!r}{suggestion(family, known)}"
        return [doc.problem(("models", index, "source"), message)]
    if _norm(family) in {_norm(pipeline.family), _norm(pipeline.name)}:
        return []
    message = (
        f"demo model family {family!r} does not match pipeline {pipeline.name!r} "
        f"(family {pipeline.family!r}); its chat format and markers would not fit"
    )
    return [doc.problem(("models", index, "source"), message)]


def _demo_families() -> tuple[str, ...]:
    try:
        from pipeserve.engine.demo import DEMO_FAMILIES
    except ImportError:  # the demo builder is optional for validation
        return ()
    return tuple(DEMO_FAMILIES)


# --- entry points --------------------------------------------------------------------


def load_server_config(path: Path | str, registry: Mapping[str, StageSpec] | None = None) -> LoadedConfig:
    """Validate a server config and the pipelines it uses; raise ConfigError with every problem."""
    loaded, problems = Validator(registry).config(Path(path))
    if problems or loaded is None:
        raise ConfigError(problems)
    return loaded


def load_pipeline(path: Path | str, registry: Mapping[str, StageSpec] | None = None) -> LoadedPipeline:
    """Validate one pipeline file; raise ConfigError with every problem."""
    loaded, problems = Validator(registry).pipeline(Path(path))
    if problems or loaded is None:
        raise ConfigError(problems)
    return loaded


@dataclass
class Report:
    files: list[Path] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


def validate_paths(files: Iterable[Path], registry: Mapping[str, StageSpec] | None = None) -> Report:
    """Validate files of either kind together; each problem is reported once."""
    validator = Validator(registry)
    report = Report()
    for path in files:
        report.files.append(path)
        for problem in validator.file(path):
            if problem not in report.problems:
                report.problems.append(problem)
    return report
