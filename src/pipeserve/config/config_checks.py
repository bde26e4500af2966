"""Checks of one server config: its models and endpoints, and the pipelines its models use.

`check_config` returns a LoadedConfig (the validated config plus each pipeline by name) or
every problem found; the pipelines come from `validator.pipeline` (a Validator, which
checks each file once per run).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pydantic import ValidationError

from pipeserve.config.adapter_checks import (
    adapter_names,
    check_adapter_files,
    check_adapter_names,
)
from pipeserve.config.detect import AUTO
from pipeserve.config.kv_cache_checks import check_kv_cache
from pipeserve.config.loader import YamlDoc, display_path, dotted
from pipeserve.config.models import EMBEDDING_APIS, ModelEntry, ServerConfig
from pipeserve.config.pipeline_checks import EMBED_KINDS, LoadedPipeline
from pipeserve.config.pipeline_folder import pipeline_folder, shipped_pipelines
from pipeserve.config.problems import PathKey, Problem, pydantic_problems, suggestion
from pipeserve.config.sharding_checks import check_sharding
from pipeserve.config.source_checks import check_sources
from pipeserve.config.speculative_checks import check_speculative

# Mirrors pipeserve.api's protocol names (a test keeps them equal); a constant here so
# validation does not import the protocol modules.
KNOWN_APIS: tuple[str, ...] = (
    "openai-chat",
    "anthropic-messages",
    "openai-responses",
    "openai-completions",
    "ollama",
    "llama-cpp",
)
YAML_SUFFIXES: tuple[str, ...] = (".yaml", ".yml")


@dataclass(frozen=True)
class LoadedConfig:
    """A validated server config plus every pipeline its models use (by name)."""

    path: Path
    config: ServerConfig
    pipelines: dict[str, LoadedPipeline]
    # `pipeline: auto` models, once resolved (pipeserve.config.auto): name -> Detection
    detections: dict[str, Any] = field(default_factory=dict)
    text: str = ""  # the config file as validated (secrets included: redact before showing)

    def pipeline_for(self, model: ModelEntry | str) -> LoadedPipeline:
        entry = model if isinstance(model, ModelEntry) else self.model(model)
        return self.pipelines[entry.chain_name]

    def model(self, name: str) -> ModelEntry:
        for entry in self.config.models:
            if entry.name == name:
                return entry
        raise KeyError(name)


class PipelineSource(Protocol):
    """Where check_config gets the checked pipelines from (a Validator)."""

    # Check the adapters' files too (`pipeserve validate`); the server's load does not.
    adapter_files: bool

    def pipeline(self, path: Path) -> tuple[LoadedPipeline | None, list[Problem]]: ...


def check_config(
    doc: YamlDoc, validator: PipelineSource
) -> tuple[LoadedConfig | None, list[Problem]]:
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
    names = {m.get("name") for _, m in models} | adapter_names(models)
    problems += _check_endpoints(doc, endpoints, names)
    problems += _check_key_scopes(doc, names)
    problems += check_sources(doc, models)
    problems += check_adapter_names(doc, models)
    if validator.adapter_files:
        problems += check_adapter_files(doc, models)
    pipelines, pipeline_problems = _check_model_pipelines(doc, models, validator)
    problems += pipeline_problems
    if parsed is not None:
        problems += check_sharding(doc, parsed)
        problems += check_speculative(doc, parsed)
        problems += check_kv_cache(doc, parsed)
    if problems or parsed is None:
        return None, problems
    return LoadedConfig(doc.path, parsed, pipelines, text=doc.text), []


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
        if isinstance(api, str) and api not in KNOWN_APIS + EMBEDDING_APIS:
            message = f"unknown api {api!r}{suggestion(api, KNOWN_APIS + EMBEDDING_APIS)}"
            problems.append(doc.problem(("endpoints", i, "api"), message))
        restrict = endpoint.get("models")
        for j, name in enumerate(restrict if isinstance(restrict, list) else []):
            if isinstance(name, str) and name not in names:
                message = f"no model named {name!r}{suggestion(name, names)}"
                problems.append(doc.problem(("endpoints", i, "models", j), message))
    return problems


def _check_key_scopes(doc: YamlDoc, model_names: set[Any]) -> list[Problem]:
    """A key scoped to a model that does not exist is a typo, not an empty scope."""
    names = {n for n in model_names if isinstance(n, str)}
    server = doc.data.get("server")
    keys = server.get("api_keys") if isinstance(server, dict) else None
    problems = []
    for i, entry in enumerate(keys if isinstance(keys, list) else []):
        scope = entry.get("models") if isinstance(entry, dict) else None
        for j, name in enumerate(scope if isinstance(scope, list) else []):
            if isinstance(name, str) and name not in names:
                message = f"no model named {name!r}{suggestion(name, names)}"
                problems.append(doc.problem(("server", "api_keys", i, "models", j), message))
    return problems


def _check_model_pipelines(
    doc: YamlDoc, models: list[tuple[int, dict[str, Any]]], validator: PipelineSource
) -> tuple[dict[str, LoadedPipeline], list[Problem]]:
    problems: list[Problem] = []
    pipelines: dict[str, LoadedPipeline] = {}
    folder_value = doc.data.get("pipelines_dir")
    if folder_value is not None and not isinstance(folder_value, str):
        return pipelines, problems  # pydantic reported the type
    folder = pipeline_folder(doc.path, folder_value)
    if not folder.is_dir() and "pipelines_dir" in doc.data:
        return pipelines, [
            doc.problem(("pipelines_dir",), f"no such folder: {display_path(folder)}")
        ]
    available = _pipeline_files(folder)
    for i, model in models:
        name = model.get("pipeline")
        if model.get("kind") in EMBED_KINDS:
            problems += _check_embedding(doc, i, model, available, validator, pipelines)
            continue
        if not isinstance(name, str) or not name:
            continue
        if name == AUTO:
            problems += _check_auto(doc, i, available, validator, pipelines, problems)
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


def _check_auto(
    doc: YamlDoc,
    index: int,
    available: dict[str, Path],
    validator: PipelineSource,
    pipelines: dict[str, LoadedPipeline],
    seen: list[Problem],
) -> list[Problem]:
    """`pipeline: auto`: every pipeline of the folder with a detect section is a candidate."""
    problems: list[Problem] = []
    for name, path in {**_embedding_files(available), **available}.items():
        loaded, file_problems = validator.pipeline(path)
        problems += [p for p in file_problems if p not in seen and p not in problems]
        if loaded is not None and (loaded.detect is not None or loaded.kind in EMBED_KINDS):
            pipelines[name] = loaded  # an embedding folder's chain is its kind's
    if not problems and not any(p.detect for p in pipelines.values()):
        message = "pipeline auto: no pipeline in the folder has a `detect:` section"
        problems.append(doc.problem(("models", index, "pipeline"), message))
    return problems


def _embedding_files(available: dict[str, Path]) -> dict[str, Path]:
    """The embedding and rerank pipelines: the folder's, else the shipped ones."""
    shipped = _pipeline_files(shipped_pipelines())
    return {
        k: available.get(k) or shipped[k] for k in EMBED_KINDS if k in available or k in shipped
    }


def _check_embedding(
    doc: YamlDoc,
    index: int,
    model: dict[str, Any],
    available: dict[str, Path],
    validator: PipelineSource,
    pipelines: dict[str, LoadedPipeline],
) -> list[Problem]:
    """An embedding or rerank model's pipeline: its own (not `auto`), else its kind's."""
    kind, name = str(model.get("kind")), model.get("pipeline")
    if not isinstance(name, str) or name in ("", AUTO):
        name = kind
    path = available.get(name) or _embedding_files(available).get(name)
    if path is None:
        message = f"no pipeline {name!r} in {display_path(shipped_pipelines())}"
        return [doc.problem(("models", index, "pipeline"), message)]
    loaded, problems = validator.pipeline(path)
    if loaded is None:
        return problems
    if loaded.kind != kind:
        message = f"pipeline {name!r} is of kind {loaded.kind}; this model is of kind {kind}"
        return [doc.problem(("models", index, "pipeline"), message)]
    pipelines[name] = loaded
    return []


def _pipeline_files(folder: Path) -> dict[str, Path]:
    if not folder.is_dir():
        return {}
    return {
        p.stem: p for p in sorted(folder.iterdir()) if p.suffix in YAML_SUFFIXES and p.is_file()
    }


def _norm(name: str) -> str:
    return name.lower().replace("-", "_")


def _check_demo_family(
    doc: YamlDoc, index: int, model: dict[str, Any], pipeline: LoadedPipeline
) -> list[Problem]:
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
        from pipeserve.engine.weights.demo.build import DEMO_FAMILIES
    except ImportError:  # the demo builder is optional for validation
        return ()
    return tuple(DEMO_FAMILIES)
