"""Served models and their built chains: name (or alias) -> runtime and stages."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel

from pipeserve.config.models import ModelEntry
from pipeserve.engine.base import ModelRuntime
from pipeserve.errors import ApiError
from pipeserve.stages.base import STAGE_REGISTRY, BuildEnv, Chain, Stage, StageRole
from pipeserve.stages.embedding import EmbedChain, load_embed_stages


@dataclass(frozen=True)
class StageDecl:
    """One validated pipeline stage: its kind, params and role."""

    kind: str
    params: BaseModel
    role: StageRole


@dataclass
class ServedModel:
    entry: ModelEntry
    family: str
    runtime: ModelRuntime
    chain: Chain
    stages: tuple[StageDecl, ...] = ()  # the validated pipeline the chain was built from
    embed_chain: EmbedChain | None = None  # kind embedding / rerank: its built chain

    @property
    def name(self) -> str:
        return self.entry.name


def build_chain(stages: Sequence[StageDecl], env: BuildEnv) -> Chain:
    """Instantiate each stage once from its validated params."""
    built: list[Stage] = []
    for decl in stages:
        built.append(STAGE_REGISTRY[decl.kind].factory(decl.params, env))
    return Chain(built, [decl.role for decl in stages])


def build_embed_chain(stages: Sequence[StageDecl]) -> EmbedChain:
    """An embedding / rerank pipeline's stages, each built once from its params."""
    registry = load_embed_stages()
    return EmbedChain([registry[decl.kind].factory(decl.params) for decl in stages])


_KIND_TEXT = {
    "generation": "a generation model",
    "embedding": "an embedding model",
    "rerank": "a rerank model",
}


class ModelTable:
    """Resolves request model names (exact names first, then alias globs)."""

    def __init__(self, models: list[ServedModel]) -> None:
        self.models = models
        self._by_name = {m.name: m for m in models}
        # An adapter by its own name and as `<model>:<adapter>` -> (its model, its name).
        self._adapters: dict[str, tuple[ServedModel, str]] = {}
        for model in models:
            for adapter in model.entry.adapters:
                self._adapters[adapter.name] = (model, adapter.name)
                self._adapters[f"{model.name}:{adapter.name}"] = (model, adapter.name)

    def resolve(
        self,
        name: str | None,
        allowed: set[str] | None = None,
        sole: bool = False,
        kind: str = "generation",
    ) -> ServedModel:
        """The served model of a request's `model` (sole: no name picks the route's only
        model), which must be of `kind` (a chat route refuses an embedding model, and the
        other way round: 400 naming `model`). A LoRA adapter's name resolves to its model."""
        return self.lookup(name, allowed, sole, kind)[0]

    def lookup(
        self,
        name: str | None,
        allowed: set[str] | None = None,
        sole: bool = False,
        kind: str = "generation",
    ) -> tuple[ServedModel, str | None]:
        """resolve's model and the LoRA adapter the name picks (None: the base model)."""
        found = self._adapter(name, allowed) if name else None
        model, adapter = found if found is not None else (self._find(name, allowed, sole), None)
        if model.entry.kind != kind:
            raise ApiError(
                "invalid_request",
                f"model {model.name!r} is {_KIND_TEXT[model.entry.kind]}; this route serves"
                f" {kind} models",
                param="model",
            )
        return model, adapter

    def _adapter(self, name: str, allowed: set[str] | None) -> tuple[ServedModel, str] | None:
        """The adapter `name` names, where the scope allows it (its model's name, its
        own or its `<model>:<adapter>` name in `allowed`); `<model>:<unknown>` is a 404
        naming the model's adapters."""
        found = self._adapters.get(name)
        if found is not None:
            model, adapter = found
            names = {model.name, adapter, f"{model.name}:{adapter}"}
            return found if allowed is None or names & allowed else None
        base, colon, rest = name.rpartition(":")
        parent = self._by_name.get(base) if colon and name not in self._by_name else None
        if parent is None or (allowed is not None and parent.name not in allowed):
            return None
        known = ", ".join(a.name for a in parent.entry.adapters) or "none"
        shown = rest if len(rest) <= 200 else rest[:200] + "..."
        raise ApiError(
            "not_found",
            f"model {base!r} has no adapter {shown!r}; its adapters: {known}",
            param="model",
        )

    def _find(self, name: str | None, allowed: set[str] | None, sole: bool) -> ServedModel:
        candidates = [m for m in self.models if allowed is None or m.name in allowed]
        if not name and sole and len(candidates) == 1:
            return candidates[0]
        if not name:
            raise ApiError("invalid_request", "model: field required", param="model")
        model = self._by_name.get(name)
        if model is None:
            model = next(
                (m for m in candidates for p in m.entry.aliases if fnmatch.fnmatchcase(name, p)),
                None,
            )
        if model is None or (allowed is not None and model.name not in allowed):
            known = ", ".join(m.name for m in candidates) or "none"
            shown = name if len(name) <= 200 else name[:200] + "..."
            raise ApiError(
                "not_found", f"model {shown!r} not found; this route serves: {known}", param="model"
            )
        return model

    def visible(self, scope: set[str] | None) -> list[tuple[ServedModel, str | None]]:
        """The models and LoRA adapters (model, adapter name; None: the model itself) a
        scope may use, in config order: each model, then its adapters."""
        shown: list[tuple[ServedModel, str | None]] = []
        for model in self.models:
            if scope is None or model.name in scope:
                shown.append((model, None))
            for adapter in model.entry.adapters:
                names = {model.name, adapter.name, f"{model.name}:{adapter.name}"}
                if scope is None or names & scope:
                    shown.append((model, adapter.name))
        return shown

    def stats(self) -> dict[str, dict[str, object]]:
        return {model.name: dict(model.runtime.engine.stats()) for model in self.models}
