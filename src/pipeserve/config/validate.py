"""Validation of server configs and pipeline files, with positions and cross-file checks.

The server calls `load_server_config(path)`; `pipeserve validate` calls `validate_paths`.
Both collect every problem of a run and raise/return them together. This module holds
the Validator (which checks each file once per run) and those entry points; the checks
themselves are in pipeline_checks and config_checks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pipeserve.config.config_checks import LoadedConfig, check_config
from pipeserve.config.loader import YamlDoc, load_yaml
from pipeserve.config.pipeline_checks import LoadedPipeline, check_pipeline, stage_registry
from pipeserve.config.problems import ConfigError, Problem
from pipeserve.stages.base import StageSpec

FileKind = Literal["config", "pipeline"]


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

    def __init__(
        self, registry: Mapping[str, StageSpec] | None = None, adapter_files: bool = True
    ) -> None:
        self.registry = registry if registry is not None else stage_registry()
        # The adapters' folders are checked by validate; a server's load leaves a bad
        # adapter to its model's load (the base serves without it).
        self.adapter_files = adapter_files
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

    def pipeline(
        self, path: Path, doc: YamlDoc | None = None
    ) -> tuple[LoadedPipeline | None, list[Problem]]:
        return self._cached(self._pipelines, path, doc, lambda d: check_pipeline(d, self.registry))

    def config(
        self, path: Path, doc: YamlDoc | None = None
    ) -> tuple[LoadedConfig | None, list[Problem]]:
        return self._cached(self._configs, path, doc, lambda d: check_config(d, self))

    @staticmethod
    def _cached(
        cache: dict[Path, Checked],
        path: Path,
        doc: YamlDoc | None,
        check: Callable[[YamlDoc], Checked],
    ) -> Checked:
        key = path.resolve()
        if key not in cache:
            try:
                cache[key] = check(doc or load_yaml(path))
            except ConfigError as exc:  # unreadable or not YAML
                cache[key] = (None, exc.problems)
        return cache[key]


# --- entry points --------------------------------------------------------------------


def load_server_config(
    path: Path | str, registry: Mapping[str, StageSpec] | None = None
) -> LoadedConfig:
    """Validate a server config and the pipelines it uses; raise ConfigError with every problem.
    The adapters' files are not checked here (see Validator)."""
    loaded, problems = Validator(registry, adapter_files=False).config(Path(path))
    if problems or loaded is None:
        raise ConfigError(problems)
    return loaded


def load_pipeline(
    path: Path | str, registry: Mapping[str, StageSpec] | None = None
) -> LoadedPipeline:
    """Validate one pipeline file; raise ConfigError with every problem."""
    loaded, problems = Validator(registry).pipeline(Path(path))
    if problems or loaded is None:
        raise ConfigError(problems)
    return loaded


@dataclass
class Report:
    files: list[Path] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


def validate_paths(
    files: Iterable[Path],
    registry: Mapping[str, StageSpec] | None = None,
    validator: Validator | None = None,
) -> Report:
    """Validate files of either kind together; each problem is reported once."""
    validator = validator or Validator(registry)
    report = Report()
    for path in files:
        report.files.append(path)
        for problem in validator.file(path):
            if problem not in report.problems:
                report.problems.append(problem)
    return report
