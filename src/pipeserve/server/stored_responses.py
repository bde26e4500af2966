"""Stored Responses over HTTP: `GET` / `DELETE /v1/responses/{id}` (GET also as a
replayed stream with `?stream=true`) and `GET /v1/responses/{id}/input_items` (a page,
`after` / `limit` / `order` as OpenAI defines them). Unknown, deleted and expired ids
are a 404 naming the id, in the Responses error shape. So is another API key's response,
or one of a model outside the key's (and the route's) models: a key sees only its own."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import falcon

from pipeserve.api.base import WireProtocol
from pipeserve.api.openai_responses.replay import replay_events
from pipeserve.api.openai_responses.state import store_fault
from pipeserve.api.sse import sse_event
from pipeserve.errors import ApiError, invalid
from pipeserve.server.auth import store_owner
from pipeserve.server.generation import HttpOptions, ProtocolErrors
from pipeserve.store import ResponseStore, StoreError
from pipeserve.store.base import Owner

T = TypeVar("T")
log = logging.getLogger("pipeserve.http")
DEFAULT_LIMIT = 20
MAX_LIMIT = 100


class _StoreResource:
    def __init__(
        self,
        protocol: WireProtocol,
        store: ResponseStore,
        options: HttpOptions,
        allowed: set[str] | None = None,
    ) -> None:
        self.store = store
        self.options = options
        self.allowed = allowed
        self.errors = ProtocolErrors(protocol)

    def answer(
        self, req: falcon.Request, resp: falcon.Response, work: Callable[[Owner], T]
    ) -> None:
        """Run `work` for the request's owner (it fills resp); store faults and ApiErrors
        become protocol errors."""
        try:
            grant = self.options.keys.authenticate(req)
            work(store_owner(grant, self.allowed))
        except StoreError as exc:
            self.errors.render(resp, store_fault(exc))
        except ApiError as error:
            self.errors.render(resp, error)
        except Exception as exc:  # a bug: still answer in the protocol's shape
            log.exception("stored response request failed")
            self.errors.render(resp, ApiError("internal", f"internal error: {type(exc).__name__}"))


def not_found(response_id: str) -> ApiError:
    return ApiError("not_found", f"Response with id '{response_id[:200]}' not found.")


class StoredResponseResource(_StoreResource):
    def on_get(self, req: falcon.Request, resp: falcon.Response, response_id: str) -> None:
        def work(owner: Owner) -> None:
            body = self.store.get(response_id, owner)
            if body is None:
                raise not_found(response_id)
            if not _flag(req, "stream"):
                resp.media = body
                return
            after = _int_param(req, "starting_after", minimum=-1)
            resp.content_type = "text/event-stream; charset=utf-8"
            resp.set_header("Cache-Control", "no-cache")
            frames = [sse_event(e, e["type"]) for e in replay_events(body, after)]
            resp.data = b"".join(frames)

        self.answer(req, resp, work)

    def on_delete(self, req: falcon.Request, resp: falcon.Response, response_id: str) -> None:
        def work(owner: Owner) -> None:
            if not self.store.delete(response_id, owner):
                raise not_found(response_id)
            resp.media = {"id": response_id, "object": "response.deleted", "deleted": True}

        self.answer(req, resp, work)


class InputItemsResource(_StoreResource):
    def on_get(self, req: falcon.Request, resp: falcon.Response, response_id: str) -> None:
        def work(owner: Owner) -> None:
            limit = _int_param(req, "limit", minimum=1, maximum=MAX_LIMIT)
            order = req.get_param("order") or "desc"
            if order not in ("asc", "desc"):
                raise invalid(f"order: {order[:50]!r} is not one of asc, desc", "order")
            ascending: Literal["asc", "desc"] = "asc" if order == "asc" else "desc"
            page = self.store.input_items(
                response_id, req.get_param("after"), limit or DEFAULT_LIMIT, ascending, owner
            )
            if page is None:
                raise not_found(response_id)
            resp.media = _page(page.items, page.has_more)

        self.answer(req, resp, work)


def _page(items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    first = items[0]["id"] if items else None
    last = items[-1]["id"] if items else None
    return {
        "object": "list",
        "data": items,
        "first_id": first,
        "last_id": last,
        "has_more": has_more,
    }


def _flag(req: falcon.Request, name: str) -> bool:
    value = (req.get_param(name) or "").lower()
    if value in ("", "false", "0"):
        return False
    if value in ("true", "1"):
        return True
    raise invalid(f"{name}: expected true or false", name)


def _int_param(
    req: falcon.Request, name: str, minimum: int, maximum: int | None = None
) -> int | None:
    raw = req.get_param(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise invalid(f"{name}: expected an integer", name) from None
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise invalid(f"{name}: must be {bound}", name)
    return value


def add_stored_response_routes(
    app: falcon.App[falcon.Request, falcon.Response],
    route: str,
    protocol: WireProtocol,
    store: ResponseStore,
    options: HttpOptions,
    allowed: set[str] | None = None,
) -> None:
    """`allowed`: the endpoint's models (None: every model)."""
    stored = StoredResponseResource(protocol, store, options, allowed)
    app.add_route(route + "/{response_id}", stored)
    items = InputItemsResource(protocol, store, options, allowed)
    app.add_route(route + "/{response_id}/input_items", items)


__all__ = ["add_stored_response_routes"]
