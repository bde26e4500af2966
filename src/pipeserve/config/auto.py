"""Resolving `pipeline: auto` entries of a validated config, once their folders exist.

Validation accepts `auto` (every pipeline with a `detect:` section becomes a candidate);
the choice needs the model folder, so it is made after the sources are fetched:
`resolve_auto(loaded, folders)` returns the config with each `auto` replaced by the
detected pipeline name, and the evidence of each choice in `detections`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from pipeserve.config.config_checks import LoadedConfig
from pipeserve.config.detect import AUTO, Detection, DetectionError, detect_pipeline, read_evidence
from pipeserve.config.loader import load_yaml
from pipeserve.config.problems import ConfigError, Problem
from pipeserve.engine.embedding.spec import detect_kind

log = logging.getLogger("pipeserve.config")


def auto_models(loaded: LoadedConfig) -> list[str]:
    return [entry.name for entry in loaded.config.models if entry.pipeline == AUTO]


def resolve_auto(loaded: LoadedConfig, folders: Mapping[str, Path]) -> LoadedConfig:
    """The config with every `pipeline: auto` replaced by its detected pipeline.

    folders: model name -> local model folder (needed for the `auto` models only).
    Raises ConfigError, positioned at the entry, when nothing fits and no fallback exists.
    """
    candidates = {
        name: p
        for name, p in loaded.pipelines.items()
        if p.detect is not None and p.kind == "generation"
    }
    models = []
    detections: dict[str, Detection] = dict(loaded.detections)
    for index, entry in enumerate(loaded.config.models):
        if entry.pipeline != AUTO:
            models.append(entry)
            continue
        kind = detect_kind(folders[entry.name]) if entry.kind == "generation" else entry.kind
        if kind is not None and kind != "generation":
            log.info("model %s: pipeline auto found %s model, pipeline %s (docs/embeddings.md)",
                     entry.name, kind, kind)  # fmt: skip
            models.append(entry.model_copy(update={"kind": kind, "pipeline": ""}))
            continue
        try:
            detection = detect_pipeline(read_evidence(folders[entry.name]), candidates)
        except DetectionError as exc:
            raise ConfigError([_problem(loaded.path, index, str(exc))]) from exc
        if detection.fallback:
            log.warning("model %s: pipeline auto chose %s", entry.name, detection.describe())
        else:
            log.info("model %s: pipeline auto chose %s", entry.name, detection.describe())
        models.append(entry.model_copy(update={"pipeline": detection.pipeline}))
        detections[entry.name] = detection
    config = loaded.config.model_copy(update={"models": models})
    return LoadedConfig(loaded.path, config, loaded.pipelines, detections, loaded.text)


def resolve_auto_with(loaded: LoadedConfig, locate: Callable[[str], Path]) -> LoadedConfig:
    """resolve_auto, finding each `auto` model's folder with locate(source)."""
    folders = {e.name: locate(e.source) for e in loaded.config.models if e.pipeline == AUTO}
    return resolve_auto(loaded, folders) if folders else loaded


def _problem(path: Path, index: int, message: str) -> Problem:
    try:
        return load_yaml(path).problem(("models", index, "pipeline"), message)
    except ConfigError:  # the file changed meanwhile; still say which entry
        return Problem(str(path), 1, 1, f"models[{index}].pipeline", message)
