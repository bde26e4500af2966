"""The embeddings and rerank routes: decode -> tokenize -> the model's engine -> encode.

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
from pipeserve.api.embeddings.encode import encode_embeddings, encode_rerank
from pipeserve.engine.base import ModelRuntime
from pipeserve.engine.embedding.engine import EmbeddingEngine
from pipeserve.engine.embedding.inputs import InputTokenizer
from pipeserve.engine.embedding.jobs import EmbedJob, EmbedResult, Sequence
from pipeserve.engine.embedding.ticket import EmbedTicket
from pipeserve.errors import ApiError, invalid
from pipeserve.server.body import read_json_body
from pipeserve.server.disconnect import watch_disconnect
from pipeserve.server.generation import HttpOptions, ProtocolErrors, request_id
from pipeserve.server.managed_engine import ManagedEngine
from pipeserve.server.metrics import Metrics
from pipeserve.server.registry import ModelTable, ServedModel
from pipeserve.server.request_log import RequestRecord, record_of

log = logging.getLogger("pipeserve.http")
DEFAULT_RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the"
    ' Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
    "<|im_end|>\n<|im_start|>user\n<Instruct>: {instruction}\n<Query>: {query}\n"
    "<Document>: {document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


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
            job = build_job(served, request, request_id(req))
            result = self.run(req, served, job, started)
            record.prompt_tokens = result.tokens
            self.metrics.prompt_tokens.labels(served.name).inc(result.tokens)
            resp.media = self.encode(request, served, result, started)
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
        self, request: EmbedRequest | RerankRequest, served: ServedModel, result: EmbedResult,
        started: float,
    ) -> dict[str, object]:  # fmt: skip
        if isinstance(request, RerankRequest):
            return encode_rerank(request, served.name, result.scores, result.tokens)
        seconds = time.monotonic() - started
        return encode_embeddings(
            self.shape, request, served.name, result.vectors, result.tokens, seconds
        )


def submit(runtime: ModelRuntime, job: EmbedJob, timeout: float) -> EmbedTicket:
    engine = runtime.engine
    if isinstance(engine, ManagedEngine):
        return engine.embed(job, timeout)
    if isinstance(engine, EmbeddingEngine):
        return engine.embed(job)
    raise invalid(f"model {runtime.name} does not embed", "model")


def build_job(served: ServedModel, request: EmbedRequest | RerankRequest, rid: str) -> EmbedJob:
    """The request's inputs as token sequences, within the model's limits."""
    runtime = served.runtime
    tokenizer = runtime.tokenizer
    spec = runtime.embedding
    assert isinstance(tokenizer, InputTokenizer) and spec is not None
    options = served.entry.embedding
    if isinstance(request, RerankRequest):
        _check_count(len(request.documents), options.max_inputs, "documents")
        return EmbedJob(rid, rerank_sequences(served, tokenizer, request), mode="score")
    _check_count(request.count, options.max_inputs, request.field)
    dimensions = check_dimensions(request.dimensions, spec.dimensions, spec.matryoshka)
    if request.texts is not None:
        seqs = tokenizer.texts(request.texts, request.field, request.truncate, request.single)
    else:
        arrays = request.token_arrays or []
        seqs = tokenizer.token_arrays(arrays, request.field, request.truncate, request.single)
    return EmbedJob(rid, seqs, mode="embed", dimensions=dimensions)


def rerank_sequences(
    served: ServedModel, tokenizer: InputTokenizer, request: RerankRequest
) -> list[Sequence]:
    """Cross-encoders read (query, document) pairs; decoder rerankers a prompt each."""
    if _is_encoder(served):
        return tokenizer.pairs(request.query, request.documents, request.truncate)
    options = served.entry.embedding
    template = options.rerank_template or DEFAULT_RERANK_TEMPLATE
    prompts = [
        template.format(instruction=options.rerank_instruction, query=request.query, document=d)
        for d in request.documents
    ]
    return tokenizer.texts(prompts, "documents", request.truncate)


def _is_encoder(served: ServedModel) -> bool:
    from pipeserve.engine.embedding.backbone import is_encoder

    return is_encoder(served.runtime.model_dir)


def _check_count(count: int, limit: int, field: str) -> None:
    if count > limit:
        raise invalid(
            f"'{field}' has {count} items; this model takes at most {limit} per request", field
        )


def check_dimensions(asked: int | None, native: int, matryoshka: bool) -> int | None:
    if asked is None or asked == native:
        return None
    if asked > native:
        raise invalid(
            f"'dimensions' is {asked}; this model's vectors have {native} dimensions", "dimensions"
        )
    if not matryoshka:
        raise invalid(
            f"'dimensions': this model's vectors have {native} dimensions and it is not"
            " configured for shorter ones (embedding.matryoshka)",
            "dimensions",
        )
    return asked
