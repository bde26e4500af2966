"""Rank 0's side of a model sharded over `pipeserve node` machines.

ClusterRankGroup is the hosts-file group (engine/sharding/group.py) with another way to
start and watch ranks 1..N-1: it places the model over the nodes there now (planning.py),
serves them the model files (files.py), sends each node its assignment, and watches them
through the node API: a GET every second is both the heartbeat the node needs to keep
its rank and the rank's state. The ring, the control channel, the lockstep batch and the
loss handling are the group's own: a rank or node that is lost loses the group, and the
next start places the model again over the nodes that answer then.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeserve.cluster.auth import cluster_token, group_secret
from pipeserve.cluster.files import FileServer, manifest
from pipeserve.cluster.node import Assignment
from pipeserve.cluster.planning import ClusterPlan, plan_cluster
from pipeserve.cluster.wire import NodeRefused, NodeUnreachable, call, split_address
from pipeserve.config.models import EngineOptions
from pipeserve.engine.sharding.engine import ShardedEngine
from pipeserve.engine.sharding.group import GroupLost, Peer, RankGroup
from pipeserve.errors import PlacementError
from pipeserve.gevent_support import os_sleep, os_socket_class, start_os_thread

log = logging.getLogger("pipeserve.cluster")

HEARTBEAT_INTERVAL = 1.0
NODE_SILENCE = 10.0  # seconds of failed heartbeats before a node counts as lost
NODE_HEARTBEAT_TIMEOUT = 30.0  # what nodes are told: stop the rank after this much silence
ENDED = ("exited", "failed", "stopped")

GROUPS: dict[str, ClusterRankGroup] = {}  # model name -> its group, for GET /v1/cluster
_GROUPS_LOCK = threading.Lock()


@dataclass
class NodeRank:
    rank: int
    address: str
    job: str = ""
    state: str = "assigning"
    detail: str = ""
    files: dict[str, Any] = field(default_factory=dict)
    last_ok: float = field(default_factory=time.monotonic)
    # When the heartbeats began to fail (None: the last one was answered). Counted from a
    # failed attempt, not from the last answer: mx.distributed.init may hold the GIL for
    # a while, and a heartbeat that was never sent proves nothing about the node.
    failing_since: float | None = None


def route_ip(target: str) -> str:
    """This machine's address on the way to `target` (no packet is sent)."""
    import socket

    sock = os_socket_class()(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.connect((target, 9))
        return str(sock.getsockname()[0])
    finally:
        sock.close()


def free_port(ip: str) -> int:
    sock = os_socket_class()()
    try:
        sock.bind((ip, 0))
        return int(sock.getsockname()[1])
    finally:
        sock.close()


class ClusterRankGroup(RankGroup):
    """A RankGroup whose other ranks run on `pipeserve node` machines."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cluster_plan: ClusterPlan | None = None
        self.node_ranks: list[NodeRank] = []
        self._files: FileServer | None = None
        with _GROUPS_LOCK:
            GROUPS[self.name] = self

    def start(self) -> Any:
        """Place the model over the nodes there now, assign their ranks, join the group."""
        token = cluster_token()
        try:
            found = plan_cluster(self.model_dir, self.sharding)
        except (PlacementError, OSError, RuntimeError) as exc:
            self.reason = f"cannot place the model: {exc}"
            raise GroupLost(self.reason) from None
        assert token is not None
        self.cluster_plan = found
        for line in found.plan.describe():
            log.info("model %s: %s", self.name, line)
        for reason in found.skipped:
            log.warning("model %s: left out %s", self.name, reason)
        self._adopt(found)
        # the control channel's secret: derived from the token on each side, never sent
        self._group_nonce = secrets.token_hex(16)
        self._token = group_secret(token, self._group_nonce)
        local_ip = route_ip(split_address(found.nodes[0][0])[0])
        ring = [[f"{local_ip}:{free_port(local_ip)}"]]
        ring += [[f"{split_address(a)[0]}:{int(r['ring_port'])}"] for a, r in found.nodes]
        self._listen(local_ip)
        self._write_ring(ring)
        files = manifest(self.model_dir)
        self._files = FileServer(local_ip, token, self.model_dir, files)
        self._assign_all(found, ring, files, token)
        start_os_thread(self._watch, name=f"pipeserve-shard-watch-{self.name}")
        start_os_thread(lambda: self._heartbeats(token), name=f"pipeserve-node-beat-{self.name}")
        self._accept_all()
        # Every rank has its files (a rank starts once they are fetched): no more serving.
        self._files.close()
        return self._join(len(ring))

    def _adopt(self, found: ClusterPlan) -> None:
        """Rank 0's own options take the plan's rank count and layer split."""
        self.sharding.ranks = len(found.plan.shares)
        if self.sharding.strategy == "pipeline":
            self.sharding.split = found.plan.split

    def _peer_options(self) -> EngineOptions:
        sharding = self.sharding.model_copy(update={"nodes": None, "memory": None})
        return self.options.model_copy(update={"sharding": sharding})

    def _assign_all(
        self, found: ClusterPlan, ring: list[list[str]], files: list[Any], token: str
    ) -> None:
        options = self._peer_options()
        for rank, (address, _) in enumerate(found.nodes, 1):
            share = found.plan.shares[rank]
            assignment = Assignment(
                model=self.name,
                rank=rank,
                ring=ring,
                control=self._control,
                group_nonce=self._group_nonce,
                options=options,
                files=files,
                files_host=self._files.ip if self._files else "",
                files_port=self._files.port if self._files else 0,
                layers=share.layers,
                heartbeat_timeout=NODE_HEARTBEAT_TIMEOUT,
            )
            node = NodeRank(rank, address)
            self.node_ranks.append(node)
            self.peers.append(Peer(rank, -1))
            try:
                answer = call(address, "POST", "/v1/node/ranks", token,
                              assignment.model_dump(mode="json"), timeout=10.0)  # fmt: skip
            except (NodeRefused, NodeUnreachable) as exc:
                raise GroupLost(f"rank {rank}: {exc}") from None
            node.job, node.state = str(answer["id"]), str(answer["state"])
            log.info("model %s: rank %d assigned to node %s", self.name, rank, address)

    def _heartbeats(self, token: str) -> None:
        while self._phase in ("starting", "running"):
            for node in self.node_ranks:
                if not node.job:
                    continue
                try:
                    answer = call(node.address, "GET", f"/v1/node/ranks/{node.job}", token,
                                  timeout=2.0)  # fmt: skip
                except (NodeUnreachable, NodeRefused):
                    node.failing_since = node.failing_since or time.monotonic()
                    continue
                node.state, node.detail = str(answer["state"]), str(answer.get("detail", ""))
                node.files = answer.get("files") or {}
                node.last_ok, node.failing_since = time.monotonic(), None
            os_sleep(HEARTBEAT_INTERVAL)

    def _problem(self) -> str | None:
        now = time.monotonic()
        for node in self.node_ranks:
            if node.state in ENDED:
                return f"rank {node.rank} on node {node.address} {node.state}: {node.detail}"
            failing = node.failing_since
            if failing is not None and now - failing > NODE_SILENCE:
                return f"node {node.address} (rank {node.rank}) has not answered for {NODE_SILENCE:g} s"
        started = self.step_started
        timeout = self.sharding.step_timeout
        if started is not None and now - started > timeout:
            return f"an engine step took more than step_timeout ({timeout:g} s): a rank hangs"
        if self._phase == "starting" and now > self._deadline + 5.0:
            return "the group did not start within start_timeout"
        return None

    def _kill_all(self) -> None:
        token = cluster_token()
        for node in self.node_ranks:
            if token and node.job and node.state not in ENDED:
                try:
                    call(node.address, "DELETE", f"/v1/node/ranks/{node.job}", token, timeout=2.0)
                except (NodeUnreachable, NodeRefused) as exc:
                    # the node stops the rank itself once our heartbeats stop
                    log.warning("model %s: could not stop rank %d: %s", self.name, node.rank, exc)

    def _reap(self) -> None:
        """No local processes to reap: the nodes own their ranks."""

    def stop(self) -> None:
        super().stop()
        if self._files is not None:
            self._files.close()

    def view(self) -> dict[str, Any]:
        """This model's part of GET /v1/cluster."""
        found = self.cluster_plan
        ranks = []
        for node in self.node_ranks:
            ranks.append({"rank": node.rank, "address": node.address, "state": node.state,
                          "detail": node.detail, "files": node.files,
                          "heartbeat_age_s": round(time.monotonic() - node.last_ok, 1)})  # fmt: skip
        return {
            "strategy": self.sharding.strategy,
            "cluster": self.sharding.cluster,
            "nodes": self.sharding.nodes,
            "healthy": self.healthy,
            "reason": self.reason,
            "placement": found.plan.as_dict() if found else None,
            "plan": found.plan.describe() if found else [],
            "machines": ([{"address": "this machine", **found.local}] if found else [])
            + ([{"address": a, **r} for a, r in found.nodes] if found else []),
            "left_out": found.skipped if found else [],
            "ranks": ranks,
        }


class ClusterShardedEngine(ShardedEngine):
    """A sharded engine whose group is placed over `pipeserve node` machines."""

    def _start(self, model_dir: Path, options: EngineOptions) -> Any:
        self.group = ClusterRankGroup(self.name, model_dir, options, self._on_lost)
        model = super()._start(model_dir, options)
        self._stats["shard_ranks"] = len(self.group.node_ranks) + 1
        return model


def cluster_view() -> dict[str, Any]:
    """GET /v1/cluster: every node-placed model of this process, its machines and health."""
    with _GROUPS_LOCK:
        groups = dict(GROUPS)
    models = {name: group.view() for name, group in groups.items()}
    nodes: dict[str, Any] = {}
    for view in models.values():
        for machine in view["machines"]:
            nodes.setdefault(machine["address"], {k: v for k, v in machine.items() if k != "ranks"})
    return {"nodes": list(nodes.values()), "models": models, "token_set": bool(cluster_token())}
