"""A cluster that forms itself (docs/cluster.md), on three emulated machines: the server
on m1, `pipeserve node` on m2 and m3, found over mDNS on the bridge or named by address.
The tests run in file order: the last one cuts m3's link.

The model is a 6-layer float32 qwen3 (6 heads, 3 KV heads) built here, so it splits over
3 ranks both ways. Each node starts with an empty model folder: it fetches the files
from the serving machine (sha256-checked). The nodes offer unequal memory (--memory), so
the pipeline split follows it. Bounded: two servers, two nodes, a few short answers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeserve.cluster.wire import NodeRefused, NodeUntrusted, call
from pipeserve.engine.weights.demo.build import write_demo_model
from pipeserve.engine.weights.demo.families import QWEN3
from pipeserve.settings import pipeserve_home
from tests.multimachine.harness import Cluster, Machine, wait_port
from tests.multimachine.inner.sharded import secrets_in_listings
from tests.server.serverproc import REPO, pipeserve_command, server_process

pytestmark = [pytest.mark.multimachine, pytest.mark.sharded, pytest.mark.server]

TOKEN = "test-cluster-token-" + "7" * 16
CLUSTER = "ns-test"
NODE_PORT = 7337
PROMPTS = ["Say hello", "Write a haiku about the sea"]
GIB = 2**30
SIX_LAYERS = {**QWEN3.config, "num_hidden_layers": 6, "num_attention_heads": 6,
              "num_key_value_heads": 3, "intermediate_size": 192}  # fmt: skip


@pytest.fixture(scope="module")
def machines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(3, tmp_path_factory.mktemp("machines"), ssh=False) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("six-layer-qwen3")
    write_demo_model(replace(QWEN3, config=SIX_LAYERS), folder, pipeserve_home() / "cache")
    return folder


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PIPESERVE_CLUSTER_TOKEN": TOKEN, **extra}


def start_node(
    machine: Machine,
    folder: Path,
    memory: str,
    port: int = NODE_PORT,
    node_env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    argv = [*pipeserve_command(), "node", "--cluster", CLUSTER, "--memory", memory,
            "--port", str(port), "--models", str(folder)]  # fmt: skip
    logs = Path(os.environ.get("PYTEST_SERVER_LOG_DIR", folder.parent))
    with open(logs / f"pipeserve-node-{machine.name}-{port}.log", "wb") as log:
        proc = machine.popen(argv, env=node_env or env(), stdout=log, stderr=log)
    wait_port(machine.ip, port)
    return proc


@pytest.fixture(scope="module")
def nodes(machines: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Any]]:
    """m2 offers 3 GiB, m3 2 GiB; each keeps fetched model files in an empty folder."""
    _, m2, m3 = machines.machines
    work = tmp_path_factory.mktemp("nodes")
    procs = [start_node(m2, work / "m2-models", "3GiB"), start_node(m3, work / "m3-models", "2GiB")]
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def write_config(folder: Path, model: Path, sharding: str) -> Path:
    config = folder / "cluster.yaml"
    config.write_text(
        f"pipelines_dir: {REPO / 'pipelines'}\n"
        "models:\n"
        f"  - {{name: plain, source: '{model}', pipeline: qwen3}}\n"
        f"  - name: split\n    source: '{model}'\n    pipeline: qwen3\n"
        f"    options:\n      sharding: {sharding}\n"
        "endpoints:\n  - {route: /v1/chat/completions, api: openai-chat}\n"
    )
    return config


def answer(base: str, model: str, prompt: str) -> tuple[str, int]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 10, "temperature": 0}  # fmt: skip
    reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()
    return reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"]


def assert_split_equals_plain(base: str) -> None:
    for prompt in PROMPTS:
        assert answer(base, "split", prompt) == answer(base, "plain", prompt)


def test_discovery_finds_both_nodes_of_the_cluster_only(
    machines: Cluster, nodes: list[Any]
) -> None:
    m1 = machines.machines[0]
    look = [sys.executable, "-m", "pipeserve.cluster.discovery", "--timeout", "2"]
    found = m1.run([*look, "--cluster", CLUSTER], capture_output=True, text=True, timeout=60)
    assert json.loads(found.stdout) == ["10.77.0.2:7337", "10.77.0.3:7337"], found.stderr
    other = m1.run([*look, "--cluster", "another"], capture_output=True, text=True, timeout=60)
    assert json.loads(other.stdout) == []


def rank_pids(machine: Machine) -> list[int]:
    reply = call(f"{machine.ip}:{NODE_PORT}", "GET", "/v1/node", TOKEN, timeout=10)
    return [r["pid"] for r in reply["ranks"] if r["state"] == "running"]


def test_tensor_over_nodes_named_by_address_equals_unsharded(
    machines: Cluster, nodes: list[Any], model: Path, tmp_path: Path
) -> None:
    m1 = machines.machines[0]
    listed = "['10.77.0.3:7337', '10.77.0.2']"  # the default port may be left out
    config = write_config(tmp_path, model, f"{{strategy: tensor, nodes: {listed}}}")
    with server_process(config, env(), 300, m1.command([]), m1.ip) as (base, _):
        assert_split_equals_plain(base)
        view = httpx.get(f"{base}/v1/cluster", timeout=10).json()["models"]["split"]
        holds = [(r["machine"]["address"], r["holds"]) for r in view["placement"]["ranks"]]
        assert holds == [("this machine", "1/3 of every layer"),
                         ("10.77.0.3:7337", "1/3 of every layer"),
                         ("10.77.0.2", "1/3 of every layer")]  # fmt: skip
        for rank in view["ranks"]:
            # each node lacked the model: it fetched it from m1 and checked every sha256
            assert "model.safetensors" in rank["files"]["fetched"]
            assert rank["files"]["sha256_checked"] is True
        # the group's token reached each node's rank on its stdin: in no process listing
        assert not secrets_in_listings(machines), secrets_in_listings(machines)


def test_a_node_needs_the_token_and_refuses_requests_not_signed_with_it(
    machines: Cluster, nodes: list[Any], tmp_path: Path
) -> None:
    m2 = machines.machines[1]
    no_token = {k: v for k, v in os.environ.items() if k != "PIPESERVE_CLUSTER_TOKEN"}
    argv = [*pipeserve_command(), "node", "--port", "7338", "--models", str(tmp_path)]
    refused = m2.run(argv, env=no_token, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1
    assert (
        refused.stderr.strip()
        .splitlines()[-1]
        .startswith("pipeserve node: refusing to start: PIPESERVE_CLUSTER_TOKEN is not set")
    )
    address = f"{m2.ip}:{NODE_PORT}"
    assignment = {"model": "split", "rank": 1}
    with pytest.raises(NodeUntrusted, match="HTTP 401: wrong signature"):
        call(address, "POST", "/v1/node/ranks", TOKEN[:-1] + "x", assignment, timeout=10)
    bearer = {"Authorization": f"Bearer {TOKEN}"}  # the token itself proves nothing
    sent = httpx.post(
        f"http://{address}/v1/node/ranks", json=assignment, headers=bearer, timeout=10
    )
    assert sent.status_code == 401
    command = {**assignment, "command": "touch /tmp/pwned"}
    with pytest.raises(NodeRefused, match="invalid assignment") as invalid:
        call(address, "POST", "/v1/node/ranks", TOKEN, command, timeout=10)
    assert invalid.value.status == 400 and not isinstance(invalid.value, NodeUntrusted)


def wait_for_ranks(base: str, count: int, timeout: float) -> list[dict[str, Any]]:
    """The placement once the model serves again on `count` ranks."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            view = httpx.get(f"{base}/v1/cluster", timeout=5).json()["models"].get("split")
            healthy = httpx.get(f"{base}/health", timeout=5).status_code == 200
        except (httpx.HTTPError, ValueError):
            view, healthy = None, False
        if healthy and view and view["healthy"] and len(view["placement"]["ranks"]) == count:
            return list(view["placement"]["ranks"])
        time.sleep(1)
    raise AssertionError(f"not placed again on {count} ranks within {timeout} s")


@pytest.fixture(scope="module")
def pipeline_server(
    machines: Cluster, nodes: list[Any], model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A server on m1 whose `split` is placed over the nodes found on the LAN."""
    m1 = machines.machines[0]
    sharding = f"{{strategy: pipeline, nodes: auto, cluster: {CLUSTER}, memory: 1GiB}}"
    config = write_config(tmp_path_factory.mktemp("pipeline"), model, sharding)
    # 1 : 3 : 2 GiB (less the replicated embeddings) over 6 layers; rank 0 holds the last
    explain = m1.run([*pipeserve_command(), "validate", str(config), "--explain"],
                     env=env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert "rank 1 on 10.77.0.2:7337: layers [2, 5)" in explain.stdout, explain.stderr
    assert "rank 2 on 10.77.0.3:7337: layers [0, 2)" in explain.stdout
    assert "rank 0 on this machine: layers [5, 6)" in explain.stdout
    with server_process(config, env(), 300, m1.command([]), m1.ip) as (base, _):
        yield base
    assert rank_pids(machines.machines[1]) == []  # a normal stop stops the nodes' ranks


def test_pipeline_over_discovered_nodes_follows_memory_and_equals_unsharded(
    machines: Cluster, pipeline_server: str
) -> None:
    _, m2, m3 = machines.machines
    assert_split_equals_plain(pipeline_server)
    view = httpx.get(f"{pipeline_server}/v1/cluster", timeout=10).json()["models"]["split"]
    ranks = view["placement"]["ranks"]
    assert {r["rank"]: r["layers"] for r in ranks} == {0: [5, 6], 1: [2, 5], 2: [0, 2]}
    assert [r["machine"]["usable"] for r in ranks] == [GIB, 3 * GIB, 2 * GIB]
    assert view["healthy"] is True
    for rank, machine in zip(view["ranks"], (m2, m3), strict=True):
        # the files were fetched for the tensor run: this time they are checked and reused
        assert "model.safetensors" in rank["files"]["reused"] and not rank["files"]["fetched"]
        assert rank["state"] == "running" and rank["address"] == f"{machine.ip}:7337"
    pids = rank_pids(m2) + rank_pids(m3)
    assert [machines.machine_of(pid) for pid in pids] == [m2, m3]


def test_a_node_cut_off_mid_stream_is_left_out_and_its_rank_does_not_survive(
    machines: Cluster, pipeline_server: str
) -> None:
    """m3's link is cut while a stream runs: the stream ends with an error event, the model
    is placed again over m1 and m2 without a restart, and once the link is back m3's old
    rank is gone (its node stopped it when the serving machine fell silent)."""
    base, m3 = pipeline_server, machines.machines[2]
    old = rank_pids(m3)
    assert len(old) == 1
    body = {"model": "split", "messages": [{"role": "user", "content": "Count"}],
            "max_tokens": 2000, "temperature": 0, "stream": True}  # fmt: skip
    try:
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as reply:
            lines = reply.iter_lines()
            for _ in range(3):  # the stream runs
                next(lines)
            m3.cut()
            rest = "\n".join(lines)
        assert '"error"' in rest and "data: [DONE]" not in rest.split('"error"')[0][-20:]
        placed = wait_for_ranks(base, 2, timeout=120)
        assert [r["machine"]["address"] for r in placed] == ["this machine", "10.77.0.2:7337"]
        assert_split_equals_plain(base)
    finally:
        m3.restore()
    deadline = time.monotonic() + 90
    while any(alive(pid) for pid in old) and time.monotonic() < deadline:
        time.sleep(1)
    assert not any(alive(pid) for pid in old)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_health_answers_at_once_while_requests_wait_for_a_cut_node(
    machines: Cluster, pipeline_server: str
) -> None:
    """Issue 34: m2's link is cut while requests keep arriving for `split`; the group is
    lost and its shard host restarts, requests wait for it, and every /health poll still
    answers within 0.5 s of an ordinary poll (it used to queue 1.8-2.6 s behind a
    request's reconnect)."""
    import threading

    base, m2 = pipeline_server, machines.machines[1]
    wait_for_ranks(base, 2, timeout=120)  # after the previous test: m1 and m2
    old = rank_pids(m2)
    stop = threading.Event()

    def keep_asking() -> None:
        body = {"model": "split", "messages": [{"role": "user", "content": "Count"}],
                "max_tokens": 200, "temperature": 0}  # fmt: skip
        while not stop.wait(0.3):  # requests that wait, not a flood of 503s
            try:
                httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
            except httpx.HTTPError:
                pass

    askers = [threading.Thread(target=keep_asking, daemon=True) for _ in range(3)]
    for asker in askers:
        asker.start()
    time.sleep(1.0)  # requests are in flight
    polls: list[tuple[float, int]] = []
    m2.cut()
    try:
        until = time.monotonic() + 25.0
        while time.monotonic() < until:
            started = time.monotonic()
            status = httpx.get(f"{base}/health", timeout=10).status_code
            polls.append((round(time.monotonic() - started, 3), status))
            time.sleep(0.2)
    finally:
        m2.restore()
        stop.set()
    print("health polls (seconds, status):", polls)
    assert any(status == 503 for _, status in polls), polls  # the loss was seen
    # Within 0.5 s of an ordinary poll: on a quiet machine a poll takes milliseconds; on
    # shared cores at a load of 10 (where this was measured) a healthy one took 0.13-0.25 s.
    ordinary = sorted(took for took, _ in polls)[len(polls) // 2]
    assert max(took for took, _ in polls) < ordinary + 0.5, polls
    serving_again(base, timeout=180)  # placed again over the nodes that answer
    deadline = time.monotonic() + 90
    while any(alive(pid) for pid in old) and time.monotonic() < deadline:
        time.sleep(1)
    assert not any(alive(pid) for pid in old)


def serving_again(base: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            view = httpx.get(f"{base}/v1/cluster", timeout=5).json()["models"].get("split")
            if httpx.get(f"{base}/health", timeout=5).status_code == 200 and view["healthy"]:
                return
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            pass
        time.sleep(1)
    raise AssertionError(f"not serving again within {timeout} s")
