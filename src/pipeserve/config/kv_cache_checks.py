"""Checks of `options.kv_cache` that need more than its own fields: the group size must
divide the model's attention head size where that is known without a download (a demo
model's config, a local .gguf header, a local mlx-lm folder's config.json; other sources
are checked at load), and a sharded model keeps a float cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeserve.config.loader import YamlDoc
from pipeserve.config.models import ServerConfig
from pipeserve.config.problems import PathKey, Problem

SHARDED = "a quantized KV cache is not available for a sharded model (its ranks keep float caches)"


def check_kv_cache(doc: YamlDoc, config: ServerConfig) -> list[Problem]:
    problems: list[Problem] = []
    for index, entry in enumerate(config.models):
        options = entry.options.kv_cache
        if options is None:
            continue
        at: PathKey = ("models", index, "options", "kv_cache")
        if entry.options.sharding is not None:
            problems.append(doc.problem(at, SHARDED))
        for dim in sorted(head_sizes(entry.source)):
            if dim % options.group_size:
                message = (
                    f"group_size {options.group_size} does not divide the model's attention"
                    f" head size {dim}; use a group_size that does (32, 64 or 128)"
                )
                problems.append(doc.problem(at + ("group_size",), message))
    return problems


def head_sizes(source: str) -> set[int]:
    """The attention head sizes (keys and values) of the model at `source`, where known
    without downloading or converting it; empty otherwise."""
    from pipeserve.engine.weights.demo.build import demo_source
    from pipeserve.engine.weights.demo.families import FAMILIES
    from pipeserve.engine.weights.gguf.files import GgufError, is_gguf_source
    from pipeserve.engine.weights.gguf.inspect import inspect_gguf

    try:
        family = demo_source(source)
    except ValueError:
        return set()  # the source check names it
    if family is not None:
        return _config_heads(FAMILIES[family].config)
    path = Path(source).expanduser()
    if is_gguf_source(source):
        try:
            summary = inspect_gguf(path)
        except (GgufError, OSError):
            return set()
        return {summary.key_length, summary.value_length} - {0}
    config = path / "config.json"
    if config.is_file():
        try:
            return _config_heads(json.loads(config.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            return set()
    return set()


def _config_heads(config: dict[str, Any]) -> set[int]:
    from pipeserve.engine.weights.attention_shape import head_dim

    dim = head_dim(config)
    return set() if dim is None else {dim}
