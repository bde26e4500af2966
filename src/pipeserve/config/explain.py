"""`pipeserve validate --explain`: per model, which pipeline serves it and the evidence.

For `pipeline: auto` entries this is the detection the server will make; for named
pipelines it also says what auto would have chosen, so a mismatch stands out. Model
folders are found without downloading: demo models are built (offline), hub models are
looked up in the local Hugging Face cache only, `.gguf` files are read (their header,
not converted: config/gguf_explain.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pipeserve.config.config_checks import LoadedConfig, _pipeline_files
from pipeserve.config.detect import AUTO, DetectionError, detect_pipeline, read_evidence
from pipeserve.config.gguf_explain import gguf_lines, gguf_summary
from pipeserve.config.loader import display_path
from pipeserve.config.pipeline_checks import LoadedPipeline
from pipeserve.config.pipeline_folder import pipeline_folder
from pipeserve.config.validate import Validator
from pipeserve.engine.embedding.spec import detect_kind

Locate = Callable[[str], Path | None]


def local_folder(source: str) -> Path | None:
    """The model folder of a source when it is here (demo models are built), a local
    `.gguf` file itself (its metadata is read, nothing converted), else None."""
    from pipeserve.engine.weights.demo.build import demo_source, ensure_demo_model

    family = demo_source(source)
    if family is not None:
        return ensure_demo_model(family)
    path = Path(source).expanduser()
    if path.is_dir() or (path.suffix.lower() == ".gguf" and path.is_file()):
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, local_files_only=True))
    except (ImportError, OSError, ValueError):  # not a repo id, or not in the local cache
        return None


def candidates(loaded: LoadedConfig, validator: Validator) -> dict[str, LoadedPipeline]:
    """Every valid pipeline of the config's folder that has a detect section."""
    config = loaded.config
    given = config.pipelines_dir if "pipelines_dir" in config.model_fields_set else None
    folder = pipeline_folder(loaded.path, given)
    found: dict[str, LoadedPipeline] = {}
    for name, path in _pipeline_files(folder).items():
        pipeline, _ = validator.pipeline(path)
        if pipeline is not None and pipeline.detect is not None:
            found[name] = pipeline
    return found


def explain(loaded: LoadedConfig, validator: Validator, locate: Locate = local_folder) -> list[str]:
    """Lines describing each model's pipeline choice; raises DetectionError if auto fails."""
    pool = candidates(loaded, validator)
    lines = [f"{display_path(loaded.path)}:"]
    for entry in loaded.config.models:
        summary = gguf_summary(entry)
        folder = locate(entry.source) if summary is None else summary.path
        if entry.kind != "generation":
            lines.append(f"  {entry.name}: kind {entry.kind}, pipeline {entry.chain_name}")
            continue
        if folder is None:
            where = f"{entry.source} is not here yet (downloaded when the server starts)"
            lines.append(f"  {entry.name}: pipeline {entry.pipeline}; {where}")
            continue
        kind = detect_kind(folder) if entry.pipeline == AUTO else None
        if kind is not None:
            lines.append(f"  {entry.name}: auto -> kind {kind} (docs/embeddings.md)")
            lines += gguf_lines(entry, summary) if summary is not None else []
            continue
        detection = detect_pipeline(read_evidence(folder), pool)
        if entry.pipeline == AUTO:
            lines.append(f"  {entry.name}: auto -> {detection.describe()}")
        else:
            verdict = "agrees" if detection.pipeline == entry.pipeline else "DIFFERS"
            lines.append(
                f"  {entry.name}: pipeline {entry.pipeline} (named in the config); "
                f"auto would choose {detection.describe()} [{verdict}]"
            )
        if summary is not None:
            lines += gguf_lines(entry, summary)
        sharding = entry.options.sharding
        if sharding is not None and sharding.nodes is not None:
            from pipeserve.cluster.planning import explain_lines

            lines += explain_lines(folder, sharding)
    return lines


__all__ = ["DetectionError", "explain", "local_folder"]
