"""Catalog routes a protocol declares below its endpoint (Ollama's /api/tags, /api/show,
/api/version): answered by the protocol from protocol-neutral facts about the models
the endpoint, and the request's API key, may use."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import falcon

from pipeserve.api.base import ModelFacts, WireProtocol
from pipeserve.errors import ApiError
from pipeserve.server.body import read_json_body
from pipeserve.server.generation import HttpOptions, ProtocolRoute
from pipeserve.server.registry import ModelTable, ServedModel
from pipeserve.server.request_log import annotate

log = logging.getLogger("pipeserve.http")


def model_facts(served: ServedModel) -> ModelFacts:
    runtime = served.runtime
    tokenizer = runtime.tokenizer  # mlx-lm's wrapper of a Hugging Face tokenizer (untyped)
    template = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "chat_template", None)
    stats = runtime.engine.stats()
    return ModelFacts(
        name=served.name,
        family=served.family,
        source=served.entry.source,
        folder=runtime.model_dir,
        context_length=runtime.context_length,
        capabilities=(
            served.chain.capabilities()
            if served.entry.kind == "generation"
            else frozenset({served.entry.kind})
        ),
        chat_template=template if isinstance(template, str) else None,
        resident=bool(stats.get("resident", True)),
        memory_bytes=int(stats.get("memory_bytes", 0)),
    )


class CatalogResource(ProtocolRoute):
    def answer(self, req: falcon.Request, resp: falcon.Response, body: Any) -> None:
        """`body` None: a GET; anything else: read the request's JSON body."""
        try:
            annotate(req, protocol=self.protocol.name)
            grant = self.options.keys.authenticate(req)
            annotate(req, key=grant.key_name)
            scope = grant.scope(self.allowed)
            if body is not None:
                body = read_json_body(
                    req, self.options.max_body_bytes, self.options.body_read_timeout
                )
            facts = [
                model_facts(m) if a is None else replace(model_facts(m), name=f"{m.name}:{a}")
                for m, a in self.models.visible(scope)
            ]
            resp.media = self.protocol.catalog(self.route, body, facts)
        except ApiError as error:
            annotate(req, error=error.kind)
            self.errors.render(resp, error)
        except Exception as exc:  # a bug: still answer in protocol shape
            log.exception("catalog route %s failed", self.route)
            self.errors.render(resp, ApiError("internal", f"internal error: {type(exc).__name__}"))


class CatalogGet(CatalogResource):
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        self.answer(req, resp, None)

    on_head = on_get


class CatalogPost(CatalogResource):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        self.answer(req, resp, ())


def add_catalog_routes(
    app: falcon.App[falcon.Request, falcon.Response],
    route: str,
    protocol: WireProtocol,
    models: ModelTable,
    allowed: set[str] | None,
    options: HttpOptions,
) -> None:
    """One resource per declared path; Falcon answers other methods with a 405."""
    for path, method in protocol.catalog_paths.items():
        kind = CatalogGet if method == "GET" else CatalogPost
        app.add_route(route + path, kind(path, protocol, models, allowed, options))
