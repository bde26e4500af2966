"""Cross-cutting HTTP behaviour: request ids on every response, and routing errors
(404 / 405 from Falcon itself) in the error shape of the client's protocol."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import falcon

from pipeserve.api.base import WireProtocol
from pipeserve.errors import ApiError

REQUEST_ID_HEADERS = ("request-id", "x-request-id")  # read by the anthropic / openai SDKs


class RequestIdMiddleware:
    """Gives each request an id (`req_...`), kept in `req.context.request_id` and sent
    back as `request-id` and `x-request-id` headers, as the real APIs do."""

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        from pipeserve.server.generation import new_request_id

        req.context.request_id = "req_" + new_request_id()

    def process_response(
        self, req: falcon.Request, resp: falcon.Response, resource: Any, req_succeeded: bool
    ) -> None:
        request_id = getattr(req.context, "request_id", None)
        if request_id:
            for name in REQUEST_ID_HEADERS:
                resp.set_header(name, request_id)


class RoutingErrors:
    """Renders Falcon's routing errors (unknown path, wrong method) as ApiErrors in the
    shape of the protocol served on (or under) the path, else of the protocol whose
    client header the request carries (`anthropic-version`), else the default's."""

    def __init__(
        self, protocols_by_route: Mapping[str, WireProtocol], default: WireProtocol
    ) -> None:
        self.by_route = dict(protocols_by_route)
        self.default = default
        self.by_header = {p.client_header: p for p in self.by_route.values() if p.client_header}

    def protocol_for(self, req: falcon.Request) -> WireProtocol:
        path = req.path.rstrip("/") or "/"
        for route, protocol in sorted(self.by_route.items(), key=lambda item: -len(item[0])):
            if path == route or path.startswith(route + "/"):
                return protocol
        for header, protocol in self.by_header.items():
            if req.get_header(header):
                return protocol
        return self.default

    def __call__(
        self, req: falcon.Request, resp: falcon.Response, error: falcon.HTTPError, params: Any
    ) -> None:
        if error.status_code == 404:
            api_error = ApiError("not_found", f"no route {req.method} {req.path} on this server")
        elif error.status_code == 405:
            api_error = ApiError(
                "invalid_request", f"method {req.method} is not allowed on {req.path}"
            )
        else:
            api_error = ApiError(
                "invalid_request", error.description or error.title or "bad request"
            )
        protocol = self.protocol_for(req)
        resp.status = error.status
        resp.content_type = falcon.MEDIA_JSON
        resp.media = protocol.error_body(api_error)
        for name, value in dict(error.headers or {}).items():
            resp.set_header(name, value)
