"""The Falcon resource that serves one endpoint: decode -> stages -> encode."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial

import falcon

from pipeserve.api.base import RequestMeta, WireProtocol
from pipeserve.config.models import OutputFormatDefault
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError
from pipeserve.events import ErrorEvent, Event, Finish, Usage
from pipeserve.request import GenerationRequest
from pipeserve.server.auth import KeyRing, store_owner
from pipeserve.server.body import read_json_body, replace_lone_surrogates
from pipeserve.server.disconnect import StalledWriteGuard, watch_disconnect
from pipeserve.server.metrics import Metrics
from pipeserve.server.registry import ModelTable, ServedModel
from pipeserve.server.request_log import LoggedBody, RequestRecord, record_of
from pipeserve.store.base import NOBODY_IN_PARTICULAR, Owner

log = logging.getLogger("pipeserve.http")
MOCK_HEADER = "x-mock-response"
# Seen by a client that half-closed (shutdown(SHUT_WR)) after its body; a client that
# really left never reads it. EOF is taken as "gone", as nginx does, so that nobody
# decodes thousands of tokens for a client that timed out during a long prefill.
CLIENT_CLOSED = (
    "the client closed its side of the connection before the response was ready, so the "
    "request was cancelled; keep the connection open (no half-close) until the response arrives"
)


@dataclass(frozen=True)
class HttpOptions:
    max_body_bytes: int
    request_timeout: float
    keepalive_interval: float = 5.0
    keys: KeyRing = field(default_factory=KeyRing)
    # The server's patience with a stalled client in either direction: seconds without
    # request-body bytes (408), or one response write blocked on a client that does not
    # read (connection reset, generation cancelled).
    body_read_timeout: float = 30.0


class ProtocolErrors:
    """Renders ApiError (and unexpected faults) in one protocol's own shape."""

    def __init__(self, protocol: WireProtocol) -> None:
        self.protocol = protocol

    def render(self, resp: falcon.Response, error: ApiError) -> int:
        status = self.protocol.error_status(error)
        resp.status = falcon.code_to_http_status(status)
        resp.media = self.protocol.error_body(error)
        if error.retry_after is not None:
            resp.set_header("Retry-After", str(max(1, round(error.retry_after))))
        return status


class ProtocolRoute:
    """What every resource of a protocol's route holds: its route, protocol, models (as
    far as the endpoint allows them), HTTP options and the protocol's error shape."""

    def __init__(
        self,
        route: str,
        protocol: WireProtocol,
        models: ModelTable,
        allowed: set[str] | None,
        options: HttpOptions,
    ) -> None:
        self.route = route
        self.protocol = protocol
        self.models = models
        self.allowed = allowed
        self.options = options
        self.errors = ProtocolErrors(protocol)

    def resolve(self, name: str | None, scope: set[str] | None) -> ServedModel:
        """The model a request names (or the route's only one, where the protocol lets
        `model` out)."""
        return self.models.resolve(name, scope, sole=self.protocol.model_optional)


class GenerationResource(ProtocolRoute):
    def __init__(
        self,
        route: str,
        protocol: WireProtocol,
        models: ModelTable,
        allowed: set[str] | None,
        options: HttpOptions,
        metrics: Metrics,
        default_format: OutputFormatDefault | None = None,
    ) -> None:
        super().__init__(route, protocol, models, allowed, options)
        self.default_format = default_format
        self.metrics = metrics

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        started = time.monotonic()
        label = "-"
        record = record_of(req) or RequestRecord(request_id(req), req.method, req.path)
        record.protocol = self.protocol.name
        try:
            grant = self.options.keys.authenticate(req)
            record.key = grant.key_name
            request = self.decode(req, store_owner(grant, self.allowed))
            record.stream = request.stream
            served, adapter = self.models.lookup(
                request.model, grant.scope(self.allowed), sole=self.protocol.model_optional
            )
            label = record.model = served.name
            request.model = request.model or served.name
            self.apply_default_format(request, served)
            ctxs = self.prepare(req, request, served, adapter)
        except ApiError as error:
            record.error = error.kind
            self.metrics.count_request(self.route, label, self.errors.render(resp, error))
            return
        except Exception as exc:  # a bug in a stage's prepare: still answer in protocol shape
            record.error = "internal"
            log.exception("request preparation failed")
            status = self.errors.render(
                resp, ApiError("internal", f"internal error: {type(exc).__name__}")
            )
            self.metrics.count_request(self.route, label, status)
            return
        self.respond(req, resp, served, ctxs, started, record)

    def prepare(
        self,
        req: falcon.Request,
        request: GenerationRequest,
        served: ServedModel,
        adapter: str | None = None,
    ) -> list[RequestContext]:
        """One prepared context per choice (`n`; one choice: the request itself); the
        choices' jobs share a prefill (by the request id). A choice that cannot be
        prepared (a full queue) cancels those that were."""
        if request.n > 1 and not self.protocol.serves_choices:
            raise ApiError("invalid_request", "Only n=1 is supported.", "n")
        options = served.entry.options
        capacity = options.max_batch + options.queue_size  # what the engine admits at once
        if request.n > capacity:
            message = (
                f"Invalid value for 'n': model {served.name!r} takes at most {capacity} "
                "choices at once (its max_batch + queue_size)."
            )
            raise ApiError("invalid_request", message, "n")
        ctxs = [
            RequestContext(
                request=request.choice(i) if request.n > 1 else request,
                request_id=request_id(req),
                model_name=request.model,
                served_model=served.name,
                adapter=adapter,
                keepalive_interval=self.options.keepalive_interval,
                choices=request.n,
            )
            for i in range(request.n)
        ]
        try:
            for ctx in ctxs:
                served.chain.prepare(ctx)
        except BaseException:
            for ctx in ctxs:
                ctx.cancel("error")
            raise
        return ctxs

    def apply_default_format(self, request: GenerationRequest, served: ServedModel) -> None:
        """A YAML output_format (endpoint first, then model) when the client sent none."""
        if request.output_format is not None:
            return
        if self.default_format is not None:
            request.output_format = self.default_format.to_output_format(
                f"endpoint {self.route} output_format"
            )
        elif served.entry.output_format is not None:
            request.output_format = served.entry.output_format.to_output_format(
                f"model {served.name} output_format"
            )

    def decode(self, req: falcon.Request, owner: Owner) -> GenerationRequest:
        body = read_json_body(req, self.options.max_body_bytes, self.options.body_read_timeout)
        meta = request_meta(req, self.route, owner)
        request = self.protocol.decode(body, meta)
        mock = req.get_header(MOCK_HEADER)
        if request.mock_response is None and mock is not None:
            request.mock_response = decode_header_text(mock)
        return request

    def respond(
        self,
        req: falcon.Request,
        resp: falcon.Response,
        served: ServedModel,
        ctxs: list[RequestContext],
        started: float,
        record: RequestRecord,
    ) -> None:
        """The answer of one or n choices (ctxs[0]'s cancel cancels them all)."""
        ctx = ctxs[0]
        for other in ctxs[1:]:
            ctx.on_cancel(partial(cancel_with, other, ctx))
        stop_watching = watch_disconnect(req.env, lambda: ctx.cancel("client_disconnected"))
        ctx.on_cancel(lambda: record.note_cancel(ctx.cancel_reason))
        deadline = started + self.options.request_timeout
        streams = [
            self.metrics.observe_stream(
                guarded(served.chain.run(c), c, deadline), served.name, started
            )
            for c in ctxs
        ]
        streams[0] = record.observe(streams[0])
        protocol = self.protocol
        if ctx.request.stream:
            resp.content_type = protocol.stream_content_type
            resp.set_header("Cache-Control", "no-cache")
            resp.set_header("X-Accel-Buffering", "no")
            chunks = (
                protocol.encode_stream(streams[0], ctx)
                if len(ctxs) == 1
                else protocol.encode_choices_stream(streams, ctxs)
            )
            body = closing_stream(chunks, ctx, stop_watching, protocol)
            resp.stream = self.write_guard(req, body, record)
            self.metrics.count_request(self.route, served.name, 200)
            return
        try:
            answer = (
                protocol.encode_json(streams[0], ctx)
                if len(ctxs) == 1
                else protocol.encode_choices_json(streams, ctxs)
            )
        except ApiError as raised:
            error = raised
            if ctx.cancel_reason == "client_disconnected":
                error = ApiError("invalid_request", CLIENT_CLOSED)
            record.error = error.kind
            self.metrics.count_request(self.route, served.name, self.errors.render(resp, error))
            return
        finally:
            stop_watching()
            ctx.cancel("response_complete")
        # Rendered here so that its write, too, gives up on a client that never reads
        # (a long answer with logprobs is larger than the socket buffers).
        resp.media = answer
        payload = resp.render_body() or b""
        resp.media = None
        resp.content_length = len(payload)
        resp.stream = self.write_guard(req, iter([payload]), record)
        self.metrics.count_request(self.route, served.name, 200)

    def write_guard(
        self, req: falcon.Request, body: Iterator[bytes], record: RequestRecord
    ) -> StalledWriteGuard:
        """The body as handed to the server: its log line is written when it is closed."""
        record.deferred = True
        return StalledWriteGuard(
            LoggedBody(body, record), req.env.get("gunicorn.socket"), self.options.body_read_timeout
        )


def cancel_with(other: RequestContext, ctx: RequestContext) -> None:
    """Cancel `other` (a choice) for the reason `ctx` (the first choice) was cancelled."""
    other.cancel(ctx.cancel_reason or "cancelled")


def guarded(events: Iterator[Event], ctx: RequestContext, deadline: float) -> Iterator[Event]:
    """Turn stage faults and timeouts into in-protocol error events; never raise."""
    try:
        for event in events:
            yield event
            if time.monotonic() > deadline and not isinstance(event, (Finish, Usage)):
                ctx.cancel("timeout")
                yield ErrorEvent("timeout", "request exceeded the server's request_timeout")
                yield Finish("error")
                return
    except Exception as exc:
        log.exception("stage chain failed mid-stream")
        ctx.cancel("error")
        yield ErrorEvent("internal", f"internal error: {type(exc).__name__}: {exc}")
        yield Finish("error")


def closing_stream(
    chunks: Iterable[bytes],
    ctx: RequestContext,
    stop_watching: Callable[[], None],
    protocol: WireProtocol,
) -> Iterator[bytes]:
    """The WSGI body: when the server closes it (client gone), generation stops. A fault
    in the encoder itself still ends the stream with an in-protocol `error` event (the
    SDKs raise on it) instead of a truncated body that looks like a normal end."""
    events_sent = 0
    try:
        for chunk in chunks:
            events_sent += not chunk.startswith(b":")  # keep-alive comments are not events
            yield chunk
    except Exception as exc:
        log.exception("stream encoder failed")
        ctx.cancel("error")
        error = ApiError("internal", f"internal error while streaming: {type(exc).__name__}")
        yield protocol.fault_frame(error, events_sent)
    finally:
        stop_watching()
        ctx.cancel("response_closed")


def request_meta(
    req: falcon.Request, route: str, owner: Owner = NOBODY_IN_PARTICULAR
) -> RequestMeta:
    headers = {k.lower(): v for k, v in req.headers.items()}
    return RequestMeta(route=route, headers=headers, query=dict(req.params), store_owner=owner)


def decode_header_text(value: str) -> str:
    """The X-Mock-Response value: raw UTF-8 text, or a JSON string literal (which can
    carry newlines and special characters a header cannot)."""
    try:
        value = value.encode("latin-1").decode("utf-8")  # WSGI hands headers over as latin-1
    except (UnicodeEncodeError, UnicodeDecodeError):
        pass
    if len(value) >= 2 and value.startswith('"') and value.endswith('"'):
        try:
            decoded = json.loads(value)
        except json.JSONDecodeError:
            return value
        if isinstance(decoded, str):
            return str(replace_lone_surrogates(decoded))  # `"\ud800"` cannot be tokenized
    return value


def new_request_id() -> str:
    return uuid.uuid4().hex


def request_id(req: falcon.Request) -> str:
    """The id RequestIdMiddleware gave this request (a fresh one without it)."""
    return str(getattr(req.context, "request_id", None) or "req_" + new_request_id())


__all__ = ["GenerationResource", "HttpOptions", "ProtocolErrors"]
