"""The Falcon app factory and the gunicorn entry point.

`create_app` wires, for every configured endpoint, the endpoint's wire protocol to the
built stage chain of every model the endpoint serves. Chains are built once here;
requests reuse them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import falcon

from pipeserve.api import load_builtin_protocols
from pipeserve.api.base import WireProtocol
from pipeserve.config.models import EMBEDDING_APIS, EndpointEntry, ServerConfig, ServerSection
from pipeserve.server.auth import KeyRing
from pipeserve.server.catalog import add_catalog_routes
from pipeserve.server.cluster import ClusterResource
from pipeserve.server.console.config_view import ConfigSource
from pipeserve.server.console.routes import add_console_routes
from pipeserve.server.embeddings import add_embedding_routes
from pipeserve.server.generation import GenerationResource, HttpOptions, ProtocolErrors
from pipeserve.server.metrics import Metrics
from pipeserve.server.misc import (
    CountTokensResource,
    HealthResource,
    MetricsResource,
    ModelsResource,
    RootResource,
)
from pipeserve.server.registry import ModelTable, ServedModel
from pipeserve.server.request_log import RequestLogMiddleware
from pipeserve.server.routing import RequestIdMiddleware, RoutingErrors
from pipeserve.server.stored_responses import add_stored_response_routes
from pipeserve.server.tokenize import add_tokenizer_routes
from pipeserve.store import ResponseStore

log = logging.getLogger("pipeserve.app")


def create_app(
    config: ServerConfig,
    models: Sequence[ServedModel],
    api_keys: Sequence[str] = (),
    store: ResponseStore | None = None,
    metrics: Metrics | None = None,
    source: ConfigSource | None = None,
    cluster_views: Callable[[], list[dict[str, Any]]] | None = None,
) -> falcon.App[falcon.Request, falcon.Response]:
    """Build the WSGI app for already-loaded models (see pipeserve.serving for loading).
    Without a response store, Responses endpoints are stateless. `api_keys` are the
    environment's keys, valid next to the config's server.api_keys. metrics: kept across
    config reloads (pipeserve.live_app); new when omitted. source: the config's file and
    text, for the console's Config view. cluster_views: /v1/cluster's views of the
    sharded models' shard hosts."""
    app = falcon.App(media_type=falcon.MEDIA_JSON, middleware=middleware(config.server))
    app.req_options.strip_url_path_trailing_slash = True
    app.resp_options.media_handlers[falcon.MEDIA_JSON] = compact_json_handler()
    table = ModelTable(list(models))
    metrics = metrics or Metrics(table.stats)
    server = config.server
    keys = KeyRing.build(server.api_keys, api_keys)
    options = HttpOptions(
        server.max_body_bytes,
        server.request_timeout,
        server.keepalive_interval,
        keys,
        server.body_read_timeout,
    )
    protocols = load_builtin_protocols()
    served: dict[str, WireProtocol] = {}
    for endpoint in config.endpoints:
        allowed = set(endpoint.models) if endpoint.models else None
        errors = ProtocolErrors(
            protocols["ollama" if endpoint.api == "ollama" else "openai-chat"]()
        )
        add_embedding_routes(
            app, endpoint.route, endpoint.api, table, allowed, options, metrics, errors
        )
        if endpoint.api in EMBEDDING_APIS:
            continue
        served[endpoint.route] = protocols[endpoint.api]()
        add_endpoint(app, endpoint, served[endpoint.route], table, options, metrics)
        if store is not None and served[endpoint.route].stores_responses:
            served[endpoint.route].use_store(store)
            allowed = set(endpoint.models) if endpoint.models else None
            add_stored_response_routes(
                app, endpoint.route, served[endpoint.route], store, options, allowed
            )
    app.add_error_handler(falcon.HTTPError, RoutingErrors(served, protocols["openai-chat"]()))
    models_resource = ModelsResource(table, keys)
    app.add_route("/v1/models", models_resource)
    app.add_route("/v1/models/{model_id}", models_resource, suffix="one")
    app.add_route("/health", HealthResource(table))
    app.add_route("/metrics", MetricsResource(metrics, keys))
    app.add_route("/v1/cluster", ClusterResource(keys, cluster_views))
    if server.console:
        source = source or ConfigSource()
        add_console_routes(app, config, source, table, served, keys, metrics)
    else:
        app.add_route("/", RootResource())
    return app


def middleware(server: ServerSection) -> list[Any]:
    """Request ids and the request log always; CORS (with preflight answers) only for
    configured origins."""
    chain: list[Any] = [RequestIdMiddleware(), RequestLogMiddleware()]
    origins = server.cors_allow_origins
    if origins:
        allow = "*" if "*" in origins else origins
        # Browser code may read these: the request id, and when to retry after a 429/529.
        chain.append(
            falcon.CORSMiddleware(
                allow_origins=allow, expose_headers=["request-id", "x-request-id", "retry-after"]
            )
        )
    return chain


def add_endpoint(
    app: falcon.App[falcon.Request, falcon.Response],
    endpoint: EndpointEntry,
    protocol: WireProtocol,
    table: ModelTable,
    options: HttpOptions,
    metrics: Metrics,
) -> None:
    allowed = set(endpoint.models) if endpoint.models else None
    for path in protocol.generation_paths:
        route = (endpoint.route.rstrip("/") + path) or "/"
        resource = GenerationResource(
            route, protocol, table, allowed, options, metrics, endpoint.output_format
        )
        app.add_route(route, resource)
    add_catalog_routes(app, endpoint.route.rstrip("/"), protocol, table, allowed, options)
    add_tokenizer_routes(app, endpoint.route.rstrip("/"), protocol, table, allowed, options)
    if protocol.counts_tokens:
        route = endpoint.route + "/count_tokens"
        app.add_route(route, CountTokensResource(route, protocol, table, allowed, options))


def compact_json_handler() -> falcon.media.JSONHandler:
    import json
    from functools import partial

    return falcon.media.JSONHandler(
        dumps=partial(json.dumps, ensure_ascii=False, separators=(",", ":"))
    )
