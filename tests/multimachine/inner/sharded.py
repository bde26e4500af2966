"""Helpers of the sharded-model tests on emulated machines (harness.py).

The server runs in machine m1 (rank 0, in its shard host process); the hosts file lists
m1, m2 and m3, each with a real sshd. The float32 qwen3 demo model has 2 layers, so a
placement uses 2 ranks: m1 and the first other machine that answers. Each server also
serves `plain` (the same model, unsharded): the reference, and a model that must keep
serving through every fault of the sharded one. Times are printed (`MEASURE ...`) for
the issue's notes, never asserted.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
from openai import OpenAI

from tests.multimachine.harness import Cluster, Machine, cmdline
from tests.server.serverproc import REPO, server_log, server_process

PEER_MODULE = "pipeserve.engine.sharding.peer"
SHARD_HOST = "pipeserve.server.remote.host"
PROMPTS = ["Say hello", "Write a haiku about the sea", "Count to ten"]
STEP_TIMEOUT = 10.0
WAIT = 240.0  # generous bound of every "eventually" below (not a timing assertion)
TOKEN_LIKE = re.compile(rb"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])")  # the group's token


def write_config(tmp: Path, cluster: Cluster, strategy: str) -> Path:
    hostfile = cluster.hostfile(cluster.machines, tmp / "hosts.json")
    config = tmp / f"sharded-{strategy}.yaml"
    config.write_text(
        f"pipelines_dir: {REPO / 'pipelines'}\n"
        "models:\n"
        "  - {name: plain, source: 'demo:qwen3', pipeline: qwen3}\n"
        "  - name: split\n    source: 'demo:qwen3'\n    pipeline: qwen3\n"
        f"    options:\n      sharding: {{strategy: {strategy}, hostfile: {hostfile},"
        f" step_timeout: {STEP_TIMEOUT}, start_timeout: 120}}\n"
        "endpoints:\n  - {route: /v1/chat/completions, api: openai-chat}\n"
    )
    return config


@contextmanager
def sharded_server(cluster: Cluster, tmp: Path, strategy: str) -> Iterator[tuple[str, Any]]:
    """A server in m1 serving `plain` and `split`; yields once `split` is placed."""
    m1 = cluster.machines[0]
    config = write_config(tmp, cluster, strategy)
    with server_process(config, cluster.env(), 300, m1.command([]), m1.ip) as (base, proc):
        wait_until(lambda: health(base)[0] == 200, "the sharded model was not placed")
        yield base, proc


def client_for(base: str) -> OpenAI:
    return OpenAI(base_url=f"{base}/v1", api_key="test", max_retries=0, timeout=120)


def answer(client: OpenAI, model: str, prompt: str, max_tokens: int = 16) -> dict[str, Any]:
    result = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
    )
    return {
        "message": result.choices[0].message.model_dump(),
        "usage": result.usage.completion_tokens if result.usage else None,
    }


def endless(client: OpenAI, eos_ids: list[int]) -> Iterator[Any]:
    """A stream of `split` that cannot end by itself soon (EOS banned, many tokens)."""
    stream = client.chat.completions.create(
        model="split",
        messages=[{"role": "user", "content": "Tell a long story"}],
        temperature=0,
        max_tokens=4000,
        logit_bias={str(t): -100 for t in eos_ids},
        stream=True,
    )
    return iter(stream)


def health(base: str) -> tuple[int, float]:
    """(/health's status, seconds it took to answer); status 0 when it did not answer."""
    started = time.monotonic()
    try:
        status = httpx.get(f"{base}/health", timeout=10).status_code
    except httpx.HTTPError:
        status = 0
    return status, time.monotonic() - started


def wait_until(check: Any, message: str, timeout: float = WAIT, poll: float = 0.5) -> float:
    """Poll `check` until true; returns when (monotonic) it became true."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, message
        time.sleep(poll)
    return time.monotonic()


def served_again(client: OpenAI, reference: dict[str, Any]) -> float:
    """Poll `split` until it answers; the answer must equal the unsharded one."""

    def ok() -> bool:
        try:
            got = answer(client, "split", PROMPTS[0])
        except openai.APIError:
            return False
        assert got == reference
        return True

    return wait_until(ok, "the sharded model did not serve again")


def ranks(cluster: Cluster) -> dict[int, Machine]:
    """Every rank other than 0 running now, by PID, with its machine."""
    found = {}
    for machine in cluster.machines:
        for pid in machine.pids():
            line = cmdline(pid)
            if PEER_MODULE in line and not line.split()[0].endswith("ssh"):
                found[pid] = machine
    return found


def secrets_in_listings(cluster: Cluster) -> list[str]:
    """Processes on any machine that show the group's secret token: on their command line
    (what `ps` shows anyone) its name or a word shaped like it (32 hex digits), in their
    environment (`ps e`) its name."""
    found = []
    for machine in cluster.machines:
        for pid in machine.pids():
            try:
                line = Path(f"/proc/{pid}/cmdline").read_bytes()
                environ = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:  # ended meanwhile
                continue
            if b"PIPESERVE_SHARD_TOKEN" in line + environ or TOKEN_LIKE.search(line):
                found.append(f"{machine.name} pid {pid}: {line[:200]!r}")
    return found


def stop_while_placing(cluster: Cluster, base: str, stop: Any) -> None:
    """Kill the remote rank, stop the server once the next placement has started a rank
    but not finished (503): nothing is left on any machine, no error is logged."""
    (victim,) = ranks(cluster)
    os.kill(victim, signal.SIGKILL)

    def placing() -> bool:
        return any(p != victim for p in ranks(cluster)) and health(base)[0] == 503

    wait_until(placing, "no placement followed the loss", poll=0.1)
    stop_cleanly(cluster, base, stop)


def rank0(cluster: Cluster) -> int:
    """The shard host process: rank 0 of the sharded model."""
    (pid,) = [
        p for p in cluster.machines[0].pids() if SHARD_HOST in cmdline(p) and "--only" in cmdline(p)
    ]
    return pid


def blas_of(pid: int) -> str:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return "openblas" if "libopenblas" in maps else "reference"


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def leftovers(cluster: Cluster) -> dict[str, list[str]]:
    """What still runs on each machine besides its sshd."""
    out = {}
    for machine in cluster.machines:
        sshd = machine.sshd.pid if machine.sshd is not None else -1
        rest = [f"{p}: {cmdline(p)[:120]}" for p in machine.pids() if p != sshd]
        if rest:
            out[machine.name] = rest
    return out


def log_since(base: str, offset: int) -> str:
    return server_log(base).read_bytes()[offset:].decode(errors="replace")


def log_size(base: str) -> int:
    return server_log(base).stat().st_size


def measure(name: str, seconds: float) -> None:
    print(f"MEASURE {name}: {seconds:.1f} s", flush=True)


def stop_cleanly(cluster: Cluster, base: str, stop: Any) -> None:
    """Stop the server normally: no error in the log from then on, nothing left anywhere."""
    offset = log_size(base)
    stop()
    wait_until(lambda: not leftovers(cluster), f"left running: {leftovers(cluster)}", 60)
    tail = log_since(base, offset)
    errors = [line for line in tail.splitlines() if " ERROR " in line or "Traceback" in line]
    assert not errors, tail[-4000:]
    assert os.path.exists(server_log(base))
