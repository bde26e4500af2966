"""Ollama's catalog answers, from protocol-neutral ModelFacts: `GET <route>/tags` (the
models this route and key may use), `POST <route>/show` (details, chat template, context
length, capabilities), `GET <route>/ps` (the models whose weights are loaded now)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from pipeserve.api.base import ModelFacts
from pipeserve.errors import ApiError, invalid

WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".npz", ".bin")


def modified_at(model: ModelFacts) -> str:
    folder = model.folder
    stamp = folder.stat().st_mtime if folder is not None and folder.exists() else 0.0
    return datetime.fromtimestamp(stamp, UTC).isoformat().replace("+00:00", "Z")


def weights_size(model: ModelFacts) -> int:
    folder = model.folder
    if folder is None or not folder.is_dir():
        return 0
    return sum(p.stat().st_size for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES)


def details(model: ModelFacts) -> dict[str, Any]:
    return {
        "parent_model": "",
        "format": "safetensors",
        "family": model.family,
        "families": [model.family],
        "parameter_size": "",
        "quantization_level": "",
    }


def card(model: ModelFacts) -> dict[str, Any]:
    digest = hashlib.sha256(f"{model.name}\0{model.source}".encode()).hexdigest()
    return {
        "name": model.name,
        "model": model.name,
        "modified_at": modified_at(model),
        "size": weights_size(model),
        "digest": digest,
        "details": details(model),
    }


def running(model: ModelFacts) -> dict[str, Any]:
    """An /api/ps entry: the memory the loaded model holds (weights when not reported)."""
    size = model.memory_bytes or weights_size(model)
    return {
        **card(model),
        "size": size,
        "size_vram": 0,
        "expires_at": None,
        "context_length": model.context_length,
    }


def show(model: ModelFacts) -> dict[str, Any]:
    info: dict[str, Any] = {"general.architecture": model.family}
    if model.context_length is not None:
        info[f"{model.family}.context_length"] = model.context_length
    return {
        "modelfile": f"# served by pipeserve\nFROM {model.source}\n",
        "parameters": "",
        "template": model.chat_template or "",
        "details": details(model),
        "model_info": info,
        "capabilities": capabilities(model),
        "modified_at": modified_at(model),
    }


def capabilities(model: ModelFacts) -> list[str]:
    """Ollama's list: "completion" plus extras; an embedding model says "embedding" alone."""
    if model.capabilities & {"embedding", "rerank"}:
        return sorted(model.capabilities)
    return ["completion", *sorted(model.capabilities)]


def find(body: Any, models: Sequence[ModelFacts]) -> ModelFacts:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    name = body.get("model") or body.get("name")  # `name` is the older spelling
    if not isinstance(name, str) or not name:
        raise invalid("model is required", "model")
    for model in models:
        if model.name == name.removesuffix(":latest"):
            return model
    raise ApiError("not_found", f"model '{name[:200]}' not found", "model")


__all__ = ["card", "find", "running", "show"]
