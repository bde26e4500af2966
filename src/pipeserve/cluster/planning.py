"""From `options.sharding.nodes` to a plan: find the nodes, ask each for its report (with
requests signed with the token, answers whose signature is checked), place the model. Used by rank 0 at load and by `pipeserve validate --explain`.

A node that does not answer or refuses is left out and said so (`skipped`): the model
is placed on the machines that are there, if it fits on them. The nodes are asked at
once, each call within ASK_TIMEOUT seconds in all, so one slow or trickling peer delays
placement by ASK_TIMEOUT at most, never by the number of nodes.
"""

from __future__ import annotations

import json
import logging
import queue
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from pipeserve.cluster.auth import cluster_token, token_problem
from pipeserve.cluster.discovery import discover
from pipeserve.cluster.placement import Plan, model_sizes, place
from pipeserve.cluster.report import as_machine, machine_report
from pipeserve.cluster.wire import NodeRefused, NodeUnreachable, NodeUntrusted, call
from pipeserve.config.memory import parse_size
from pipeserve.config.models import ShardingOptions
from pipeserve.errors import PlacementError
from pipeserve.gevent_support import os_simple_queue, start_os_thread

log = logging.getLogger("pipeserve.cluster")
THIS_MACHINE = "this machine"
ASK_TIMEOUT = 5.0  # seconds for one node's report, all bytes of it


@dataclass
class ClusterPlan:
    plan: Plan
    nodes: list[tuple[str, dict[str, Any]]]  # (address, report) of ranks 1..N-1, in order
    local: dict[str, Any]  # rank 0's report
    skipped: list[str] = field(default_factory=list)


def node_addresses(sharding: ShardingOptions) -> list[str]:
    if isinstance(sharding.nodes, list):
        return list(sharding.nodes)
    found = discover(sharding.cluster, sharding.discovery_timeout)
    log.info("cluster %r: found %s", sharding.cluster, ", ".join(found) or "no node")
    return found


def ask_nodes(
    addresses: list[str], token: str, cluster: str | None
) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """(address, report) of every node that answers, in the order given; why the others
    are left out (the caller says so once: a log line, or validate's plan)."""
    answers = _ask_all(addresses, token)
    nodes, skipped = [], []
    seen: dict[str, str] = {}  # node id -> the address it answered at first
    for address in addresses:
        report = answers.get(address)
        if not isinstance(report, dict):
            skipped.append(str(report or f"node {address}: no answer within {ASK_TIMEOUT:g} s"))
            continue
        same = seen.setdefault(str(report.get("node_id", address)), address)
        if same != address:
            skipped.append(f"node {address}: the same node as {same} (one rank per node)")
            continue
        if cluster is not None and report.get("cluster") != cluster:
            skipped.append(f"node {address}: in cluster {report.get('cluster')!r}, not {cluster!r}")
            continue
        nodes.append((address, report))
    return nodes, skipped


def _ask_all(addresses: list[str], token: str) -> dict[str, Any]:
    """Each node's report (or the exception that says why not), asked in parallel on OS
    threads (the caller may be a gevent worker's engine thread) under one deadline."""
    results = os_simple_queue()

    def ask(address: str) -> None:
        try:
            results.put((address, call(address, "GET", "/v1/node", token, timeout=ASK_TIMEOUT)))
        except (NodeUnreachable, NodeRefused, NodeUntrusted) as exc:
            results.put((address, exc))

    for address in dict.fromkeys(addresses):
        start_os_thread(partial(ask, address), name="pipeserve-ask-node")
    answers: dict[str, Any] = {}
    deadline = time.monotonic() + ASK_TIMEOUT + 1.0
    while len(answers) < len(set(addresses)):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            address, answer = results.get(timeout=left)
        except queue.Empty:  # the deadline passed
            break
        answers[address] = answer
    return answers


def plan_cluster(model_dir: Path, sharding: ShardingOptions) -> ClusterPlan:
    """The plan over this machine and the nodes there now; PlacementError says why not."""
    token = cluster_token()
    problem = token_problem(token)
    if problem:
        raise PlacementError(problem)
    assert token is not None
    auto = not isinstance(sharding.nodes, list)
    nodes, skipped = ask_nodes(node_addresses(sharding), token, sharding.cluster if auto else None)
    memory = parse_size(sharding.memory) if sharding.memory is not None else None
    local = machine_report(memory)
    machines = [as_machine(THIS_MACHINE, local)] + [as_machine(a, r) for a, r in nodes]
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    try:
        plan = place(sharding.strategy, machines, model_sizes(model_dir), config)
    except PlacementError as exc:
        reasons = "; ".join(skipped)
        raise PlacementError(f"{exc}" + (f" (left out: {reasons})" if reasons else "")) from None
    return ClusterPlan(plan, nodes, local, skipped)


def explain_lines(model_dir: Path, sharding: ShardingOptions) -> list[str]:
    """`validate --explain`: the placement the server would make now."""
    where = "nodes: auto" if sharding.nodes == "auto" else f"nodes: {sharding.nodes}"
    head = f"    cluster placement ({sharding.strategy}, {where}, cluster {sharding.cluster!r}):"
    try:
        found = plan_cluster(model_dir, sharding)
    except (PlacementError, OSError, RuntimeError) as exc:
        return [head, f"      cannot place it now: {exc}"]
    lines = [head] + [f"      {line}" for line in found.plan.describe()]
    return lines + [f"      left out: {reason}" for reason in found.skipped]
