"""The embeddings and rerank routes: decode -> the model's embedding chain (its pipeline's
stages: input, tokenize, encode, pool, normalize; stages/embedding/) -> encode.

One resource per route and shape (OpenAI `/v1/embeddings`, Ollama `/api/embed` and
`/api/embeddings`, `/v1/rerank`). Keys, scopes, the body limits, the request timeout,
disconnects (the job is cancelled) and the metrics work as on the generation routes;
errors come in the OpenAI shape, or Ollama's on Ollama's routes."""

from __future__ import annotations

import logging
import time

import falcon

from pipeserve.api.embeddings.decode import (
    EmbedRequest,
    RerankRequest,
    Shape,
    decode_embed,
    decode_rerank,
)
from pipeserve.api.embeddings.encode import encode_embeddings, encode_rerank, json_bytes
from pipeserve.engine.base import ModelRuntime
from pipeserve.engine.embedding.engine import EmbeddingEngine
from pipeserve.engine.embedding.jobs import EmbedJob, EmbedResult
from pipeserve.engine.embedding.ticket import EmbedTicket
from pipeserve.errors import ApiError, invalid
from pipeserve.server.body import read_json_body
from pipeserve.server.disconnect import watch_disconnect
from pipeserve.server.generation import HttpOptions, ProtocolErrors, request_id
from pipeserve.server.managed_engine import ManagedEngine
from pipeserve.server.metrics import Metrics
from pipeserve.server.registry import ModelTable, ServedModel
from pipeserve.server.request_log import RequestRecord, record_of
from pipeserve.stages.embedding.base import EmbedContext
from pipeserve.stages.embedding.embed_input import DEFAULT_RERANK_TEMPLATE

__all__ = ["DEFAULT_RERANK_TEMPLATE", "add_embedding_routes"]

log = logging.getLogger("pipeserve.http")


def add_embedding_routes(
    app: falcon.App[falcon.Request, falcon.Response],
    route: str,
    api: str,
    models: ModelTable,
    allowed: set[str] | None,
    options: HttpOptions,
    metrics: Metrics,
    errors: ProtocolErrors,
) -> None:
    """openai-embeddings and rerank serve their route; ollama adds /embed and /embeddings."""
    shapes: dict[str, Shape] = {}
    if api == "ollama":
        base = route.rstrip("/")
        shapes = {base + "/embed": "ollama", base + "/embeddings": "ollama-legacy"}
    elif api == "openai-embeddings":
        shapes = {route: "openai"}
    elif api == "rerank":
        shapes = {route: "rerank"}
    for path, shape in shapes.items():
        resource = EmbeddingsResource(path, shape, models, allowed, options, metrics, errors)
        app.add_route(path, resource)


class EmbeddingsResource:
    def __init__(
        self,
        route: str,
        shape: Shape,
        models: ModelTable,
        allowed: set[str] | None,
        options: HttpOptions,
        metrics: Metrics,
        errors: ProtocolErrors,
    ) -> None:
        self.route = route
        self.shape = shape
        self.models = models
        self.allowed = allowed
        self.options = options
        self.metrics = metrics
        self.errors = errors

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        started = time.monotonic()
        record = record_of(req) or RequestRecord(request_id(req), req.method, req.path)
        record.protocol = "rerank" if self.shape == "rerank" else f"{self.shape}-embeddings"
        label = "-"
        try:
            grant = self.options.keys.authenticate(req)
            record.key = grant.key_name
            body = read_json_body(req, self.options.max_body_bytes, self.options.body_read_timeout)
            request = (
                decode_rerank(body) if self.shape == "rerank" else decode_embed(self.shape, body)
            )
            kind = "rerank" if self.shape == "rerank" else "embedding"
            served = self.models.resolve(request.model, grant.scope(self.allowed), kind=kind)
            label = record.model = served.name
            if served.embed_chain is None:
                raise invalid(f"model {served.name} does not embed", "model")
            ctx = context_of(served, request, request_id(req))
            ctx.submit = lambda job: self.run(req, served, job, started)  # encode's way in
            served.embed_chain.run(ctx)
            record.prompt_tokens = ctx.tokens
            self.metrics.prompt_tokens.labels(served.name).inc(ctx.tokens)
            resp.data = json_bytes(self.encode(request, served, ctx, started))
            resp.content_type = falcon.MEDIA_JSON
        except ApiError as error:
            record.error = error.kind
            self.metrics.count_request(self.route, label, self.errors.render(resp, error))
            return
        except Exception as exc:  # a bug: still answer in the route's error shape
            record.error = "internal"
            log.exception("embedding request failed")
            fault = ApiError("internal", f"internal error: {type(exc).__name__}")
            self.metrics.count_request(self.route, label, self.errors.render(resp, fault))
            return
        self.metrics.count_request(self.route, served.name, 200)

    def run(
        self, req: falcon.Request, served: ServedModel, job: EmbedJob, started: float
    ) -> EmbedResult:
        timeout = self.options.request_timeout
        ticket = submit(served.runtime, job, timeout)
        stop_watching = watch_disconnect(req.env, ticket.cancel)
        try:
            result = ticket.wait(max(0.0, started + timeout - time.monotonic()))
        finally:
            stop_watching()
        if result is None:
            raise ApiError("timeout", f"the request took longer than {timeout:g} s")
        if result.error_kind == "cancelled":
            raise ApiError("invalid_request", "the request was cancelled (client disconnected)")
        if result.error is not None:
            raise ApiError(result.error_kind or "internal", result.error)
        return result

    def encode(
        self, request: EmbedRequest | RerankRequest, served: ServedModel, ctx: EmbedContext,
        started: float,
    ) -> dict[str, object]:  # fmt: skip
        if isinstance(request, RerankRequest):
            return encode_rerank(request, served.name, ctx.scores, ctx.tokens)
        seconds = time.monotonic() - started
        return encode_embeddings(self.shape, request, served.name, ctx.vectors, ctx.tokens, seconds)


def submit(runtime: ModelRuntime, job: EmbedJob, timeout: float) -> EmbedTicket:
    engine = runtime.engine
    if isinstance(engine, ManagedEngine):
        return engine.embed(job, timeout)
    if isinstance(engine, EmbeddingEngine):
        return engine.embed(job)
    raise invalid(f"model {runtime.name} does not embed", "model")


def context_of(
    served: ServedModel, request: EmbedRequest | RerankRequest, rid: str
) -> EmbedContext:
    """The decoded request as the embedding chain's protocol-neutral context."""
    ctx = EmbedContext(served.runtime, served.entry.embedding, rid, submit=_not_submitted)
    ctx.truncate = request.truncate
    if isinstance(request, RerankRequest):
        ctx.scoring, ctx.field_name = True, "documents"
        ctx.query, ctx.documents = request.query, request.documents
        return ctx
    ctx.field_name, ctx.single, ctx.asked_dimensions = (
        request.field,
        request.single,
        request.dimensions,
    )
    ctx.texts, ctx.token_arrays = request.texts, request.token_arrays
    return ctx


def _not_submitted(job: EmbedJob) -> EmbedResult:
    raise RuntimeError("the route sets ctx.submit before it runs the chain")
