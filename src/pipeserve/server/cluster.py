"""GET /v1/cluster: the machines of node-sharded models, their placement and health.

With API keys it needs an unrestricted key (it names every sharded model and machine).
A sharded model's group lives in its shard host (server/remote/host.py): `remote` gives
the views of those processes, merged here with this process's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import falcon

from pipeserve.server.auth import KeyRing, unrestricted


class ClusterResource:
    def __init__(
        self,
        keys: KeyRing | None = None,
        remote: Callable[[], list[dict[str, Any]]] | None = None,
    ) -> None:
        self.keys = keys or KeyRing()
        self.remote = remote or list

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        if not unrestricted(req, resp, self.keys, "/v1/cluster"):
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
