"""GET /v1/cluster: the machines of node-sharded models, their placement and health.

With API keys it needs an unrestricted key (it names every sharded model and machine).
"""

from __future__ import annotations

import falcon

from pipeserve.api.openai_common import openai_error_body
from pipeserve.errors import ApiError
from pipeserve.server.auth import KeyRing
from pipeserve.server.misc import openai_auth


class ClusterResource:
    def __init__(self, keys: KeyRing | None = None) -> None:
        self.keys = keys or KeyRing()

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        grant = openai_auth(req, resp, self.keys)
        if grant is None:
            return
        if grant.models is not None:
            resp.status = falcon.HTTP_403
            message = (
                "this API key is limited to some models; /v1/cluster needs an unrestricted key"
            )
            resp.media = openai_error_body(ApiError("permission", message))
            return
        from pipeserve.cluster.launch import cluster_view  # imports MLX: only when asked

        resp.media = cluster_view()
