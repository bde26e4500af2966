"""GET /v1/cluster: the machines of node-sharded models, their placement and health.

With API keys it needs an unrestricted key (it names every sharded model and machine).
A sharded model's group lives in its shard host (server/remote/host.py): `remote` gives
the views of those processes, merged here with this process's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import falcon

from pipeserve.api.openai_common import openai_error_body
from pipeserve.errors import ApiError
from pipeserve.server.auth import KeyRing
from pipeserve.server.misc import openai_auth


class ClusterResource:
    def __init__(
        self,
        keys: KeyRing | None = None,
        remote: Callable[[], list[dict[str, Any]]] | None = None,
    ) -> None:
        self.keys = keys or KeyRing()
        self.remote = remote or list

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

        resp.media = merged([cluster_view(), *self.remote()])


def merged(views: list[dict[str, Any]]) -> dict[str, Any]:
    """One /v1/cluster answer from several processes' views (models, nodes, token)."""
    out: dict[str, Any] = {"nodes": [], "models": {}, "token_set": False}
    for view in views:
        out["models"].update(view.get("models", {}))
        known = {node.get("address") for node in out["nodes"]}
        out["nodes"] += [n for n in view.get("nodes", []) if n.get("address") not in known]
        out["token_set"] = out["token_set"] or bool(view.get("token_set"))
    return out
