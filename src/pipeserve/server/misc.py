"""Small resources: health, model list, metrics, root, Anthropic token counting."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import Any

import falcon
from prometheus_client import CONTENT_TYPE_LATEST

from pipeserve.api.base import context_overflow
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError
from pipeserve.server.auth import KeyRing, openai_auth, unrestricted
from pipeserve.server.body import read_json_body
from pipeserve.server.generation import ProtocolRoute, request_id, request_meta
from pipeserve.server.metrics import Metrics
from pipeserve.server.registry import ModelTable, ServedModel
from pipeserve.server.request_log import annotate

STARTED_AT = int(time.time())
STARTED_AT_ISO = datetime.fromtimestamp(STARTED_AT, UTC).isoformat().replace("+00:00", "Z")
log = logging.getLogger("pipeserve.http")


class HealthResource:
    def __init__(self, models: ModelTable) -> None:
        self.models = models

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        names = [m.name for m in self.models.models]
        # An engine may say it cannot serve (a sharded model whose group was lost).
        unhealthy = {m.name: reason for m in self.models.models if (reason := _unhealthy(m))}
        if unhealthy:
            resp.status = falcon.HTTP_503
            resp.media = {"status": "unhealthy", "models": names, "unhealthy": unhealthy}
            return
        resp.media = {"status": "ok", "models": names}

    on_head = on_get


def _unhealthy(model: ServedModel) -> str | None:
    """Why a model's engine cannot serve (a sharded model whose group was lost, an engine
    host that is down), or None."""
    engine = model.runtime.engine
    if engine.healthy:
        return None
    return engine.health_reason or "unhealthy"


class RootResource:
    """Agent CLIs probe `HEAD /` before their first request; answer it plainly."""

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = {"service": "pipeserve", "health": "/health", "models": "/v1/models"}

    def on_head(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = falcon.MEDIA_JSON


class ModelsResource:
    """`GET /v1/models` in a shape both SDKs read: OpenAI's list (object/data, cards with
    object/created/owned_by) plus Anthropic's page fields (has_more, first_id, last_id;
    cards with type/display_name/created_at). With API keys, a key sees its own models."""

    def __init__(self, models: ModelTable, keys: KeyRing | None = None) -> None:
        self.models = models
        self.keys = keys or KeyRing()

    def visible(
        self, req: falcon.Request, resp: falcon.Response
    ) -> list[tuple[ServedModel, str | None]] | None:
        """The models and LoRA adapters the request's key may use (None: refused)."""
        grant = openai_auth(req, resp, self.keys)
        if grant is None:
            return None
        return self.models.visible(grant.scope(None))

    def _entry(self, model: ServedModel, adapter: str | None) -> dict[str, Any]:
        """A model's card, or an adapter's (`<model>:<adapter>`, its parent model named)."""
        if adapter is None:
            return self._card(model.name) | residency(model)
        facts = residency(model)
        refused = (facts.pop("adapter_errors", None) or {}).get(adapter)
        card = self._card(f"{model.name}:{adapter}") | facts
        card |= {"parent": model.name, "root": model.name, "adapter": adapter}
        return card | ({"load_error": refused} if refused else {})

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        shown = self.visible(req, resp)
        if shown is None:
            return
        data = [self._entry(model, adapter) for model, adapter in shown]
        resp.media = {
            "object": "list",
            "data": data,
            "has_more": False,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }

    on_head = on_get

    def on_get_one(self, req: falcon.Request, resp: falcon.Response, model_id: str) -> None:
        shown = self.visible(req, resp)
        if shown is None:
            return
        found = next(
            (
                (model, adapter)
                for model, adapter in shown
                if model_id
                in ((model.name,) if adapter is None else (f"{model.name}:{adapter}", adapter))
            ),
            None,
        )
        if found is None:
            resp.status = falcon.HTTP_404
            resp.media = {
                "error": {
                    "message": f"model {model_id!r} not found",
                    "type": "not_found_error",
                    "param": "model",
                    "code": "model_not_found",
                }
            }
            return
        resp.media = self._entry(*found)

    @staticmethod
    def _card(name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": STARTED_AT,
            "owned_by": "pipeserve",
            "type": "model",
            "display_name": name,
            "created_at": STARTED_AT_ISO,
        }


def residency(model: ServedModel) -> dict[str, Any]:
    """state (loaded / loading / not-loaded), load policy and memory, as LM Studio lists them;
    an embedding or rerank model adds its kind, dimensions and pooling."""
    facts = dict(model.runtime.engine.describe())
    spec = model.runtime.embedding
    if spec is not None:
        facts.update(kind=model.entry.kind, **spec.describe())
    return facts


class MetricsResource:
    """Prometheus text. With API keys it needs one that is not limited to some models
    (the metrics name every model)."""

    def __init__(self, metrics: Metrics, keys: KeyRing | None = None) -> None:
        self.metrics = metrics
        self.keys = keys or KeyRing()

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        if not unrestricted(req, resp, self.keys, "/metrics"):
            return
        resp.content_type = CONTENT_TYPE_LATEST
        resp.data = self.metrics.render()


class CountTokensResource(ProtocolRoute):
    """`<messages route>/count_tokens`: render the prompt (dry run) and count it."""

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        annotate(req, protocol=self.protocol.name)
        try:
            grant = self.options.keys.authenticate(req)
            annotate(req, key=grant.key_name)
            body = read_json_body(req, self.options.max_body_bytes, self.options.body_read_timeout)
            request = self.protocol.count_tokens_body(body, request_meta(req, self.route))
            served = self.models.resolve(request.model, grant.scope(self.allowed))
            annotate(req, model=served.name)
            ctx = RequestContext(
                request=request, request_id=request_id(req), model_name=request.model, dry_run=True
            )
            resp.media = self.protocol.count_tokens_response(prompt_tokens(served, ctx))
        except ApiError as error:
            annotate(req, error=error.kind)
            self.errors.render(resp, error)
        except Exception as exc:  # a bug in a stage's prepare: still answer in protocol shape
            log.exception("count_tokens failed")
            self.errors.render(resp, ApiError("internal", f"internal error: {type(exc).__name__}"))


def prompt_tokens(served: ServedModel, ctx: RequestContext) -> int:
    """The rendered prompt's length. A prompt over the context length is still counted:
    clients (Claude Code) count precisely to learn that they must compact."""
    try:
        served.chain.prepare(ctx)
    except ApiError as error:
        overflow = context_overflow(error)
        if overflow is None:
            raise
        return overflow[0]
    return len(ctx.prompt_token_ids or [])
