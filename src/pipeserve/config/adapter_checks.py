"""Checks of the models' LoRA adapters: names that requests can tell apart, and (with
`files`) each adapter folder by itself (engine/weights/adapters.py: config, rank, pairs of
matrices) and, where the base model is a local mlx-lm folder, against the base's linears
(read from its safetensors headers: unknown target modules, wrong shapes, missing keys).

`pipeserve validate` checks the files; the server's own config load does not (a bad
adapter is refused when its model loads, and the base serves without it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeserve.config.loader import YamlDoc
from pipeserve.config.problems import Problem


def adapter_names(models: list[tuple[int, dict[str, Any]]]) -> set[str]:
    """The names requests may use for the adapters: `<name>` and `<model>:<name>` (an
    endpoint's or a key's `models:` may list them)."""
    names: set[str] = set()
    for _, model in models:
        for _, adapter in _adapters(model):
            name = adapter.get("name")
            if isinstance(name, str):
                names |= {name, f"{model.get('name')}:{name}"}
    return names


def check_adapter_names(doc: YamlDoc, models: list[tuple[int, dict[str, Any]]]) -> list[Problem]:
    """Every adapter's own name and `<model>:<name>` name one thing only."""
    taken = {m.get("name") for _, m in models if isinstance(m.get("name"), str)}
    problems = []
    for i, model in models:
        for j, adapter in _adapters(model):
            name = adapter.get("name")
            if not isinstance(name, str):
                continue
            qualified = f"{model.get('name')}:{name}"
            clash = name if name in taken else qualified if qualified in taken else None
            if clash is not None:
                message = f"adapter name {clash!r} is already a model or adapter name"
                problems.append(doc.problem(("models", i, "adapters", j, "name"), message))
            taken |= {name, qualified}
    return problems


def check_adapter_files(doc: YamlDoc, models: list[tuple[int, dict[str, Any]]]) -> list[Problem]:
    from pipeserve.engine.weights.adapters import AdapterError, read_adapter

    problems = []
    for i, model in models:
        base = _base_linears(model.get("source"))
        for j, adapter in _adapters(model):
            name, path = adapter.get("name"), adapter.get("path")
            if not isinstance(name, str) or not isinstance(path, str):
                continue
            try:
                files = read_adapter(name, Path(path).expanduser())
                if base is not None:
                    _check_base(files, base)
            except AdapterError as error:
                problems.append(doc.problem(("models", i, "adapters", j, "path"), str(error)))
    return problems


def _adapters(model: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    value = model.get("adapters")
    if not isinstance(value, list):
        return []
    return [(j, a) for j, a in enumerate(value) if isinstance(a, dict)]


Base = tuple[dict[str, Any], int]  # (linears by path, layer count)


def _check_base(files: Any, base: Base) -> None:
    from pipeserve.engine.weights.adapters import check_against

    linears, layers = base
    check_against(files, linears, layers, "model.layers")


def _base_linears(source: Any) -> Base | None:
    """A local mlx-lm folder's linears (path -> (in, out), from its safetensors headers:
    a 2-D `.weight`; quantized where `.scales` is beside it) and layer count; None where
    the folder is not on disk or not readable that way (the load checks then)."""
    from pipeserve.engine.weights.adapters import AdapterError, safetensors_header

    if not isinstance(source, str):
        return None
    folder = Path(source).expanduser()
    config_file = folder / "config.json"
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
        header: dict[str, Any] = {}
        for file in sorted(folder.glob("*.safetensors")):
            header.update(safetensors_header(file.name, file))
    except (OSError, ValueError, AdapterError):
        return None
    layers = config.get("num_hidden_layers") if isinstance(config, dict) else None
    if not header or not isinstance(layers, int):
        return None
    bits = (config.get("quantization") or {}).get("bits", 4)
    linears: dict[str, Any] = {}
    for key, info in header.items():
        shape = info.get("shape") if isinstance(info, dict) else None
        if not key.endswith(".weight") or not isinstance(shape, list) or len(shape) != 2:
            continue
        path = key.removesuffix(".weight")
        cols = shape[1] * 32 // bits if f"{path}.scales" in header else shape[1]
        linears[path] = None if "embed" in path else (cols, shape[0])
    return linears, layers
