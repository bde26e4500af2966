"""JSON Schema (draft 2020-12) of server configs and pipeline files, for editors.

Pipeline stage items are a oneOf over the registered stage kinds (the chat stages and
the embedding chain's, stages/embedding/), each a single-key
object whose value is that kind's params schema, so yaml-language-server completes
stage names and their parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from pipeserve.config.models import PipelineFile, ServerConfig
from pipeserve.stages.base import StageSpec
from pipeserve.stages.embedding.base import EmbedStageSpec

AnySpec = StageSpec | EmbedStageSpec

DRAFT = "https://json-schema.org/draft/2020-12/schema"
SchemaKind = Literal["config", "pipeline", "all"]


def json_schema(
    kind: SchemaKind = "all", registry: Mapping[str, AnySpec] | None = None
) -> dict[str, Any]:
    """The schema of one file kind, or of either kind ("all")."""
    if registry is None:
        from pipeserve.config.pipeline_checks import embed_stage_registry, stage_registry

        registry = {**stage_registry(), **embed_stage_registry()}
    specs = [registry[k] for k in sorted(registry)]
    models: list[type[BaseModel]] = [ServerConfig, PipelineFile]
    models += [s.params_model for s in specs if s.params_model not in models]
    refs, top = models_json_schema(
        [(m, "validation") for m in models], ref_template="#/$defs/{model}"
    )
    defs: dict[str, Any] = dict(top.get("$defs", {}))

    def ref(model: type[BaseModel]) -> str:
        return str(refs[(model, "validation")]["$ref"])

    defs[_name(ref(PipelineFile))]["properties"]["stages"]["items"] = {
        "oneOf": [_stage_item(spec, ref(spec.params_model)) for spec in specs]
    }
    schema: dict[str, Any] = {"$schema": DRAFT}
    if kind == "config":
        schema |= {"title": "pipeserve server config", "$ref": ref(ServerConfig)}
    elif kind == "pipeline":
        schema |= {"title": "pipeserve pipeline", "$ref": ref(PipelineFile)}
    else:
        schema |= {
            "title": "pipeserve server config or pipeline",
            "anyOf": [{"$ref": ref(ServerConfig)}, {"$ref": ref(PipelineFile)}],
        }
    schema["$defs"] = defs
    return schema


def _name(ref: str) -> str:
    return ref.removeprefix("#/$defs/")


def _stage_item(spec: AnySpec, params_ref: str) -> dict[str, Any]:
    params: dict[str, Any] = {"$ref": params_ref}
    if not any(f.is_required() for f in spec.params_model.model_fields.values()):
        params = {"anyOf": [params, {"type": "null"}]}  # `- generate:` with no params
    if spec.description:
        params["description"] = spec.description
    return {
        "type": "object",
        "title": spec.kind,
        "description": f"{spec.kind} ({spec.role}): {spec.description}".rstrip(": "),
        "properties": {spec.kind: params},
        "required": [spec.kind],
        "additionalProperties": False,
    }
