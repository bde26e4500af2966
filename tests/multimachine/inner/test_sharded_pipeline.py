"""A pipeline-sharded model over machines: equal to unsharded, each rank on its own
machine with the same BLAS, the group's token in no process listing, a SIGKILLed and a
SIGSTOPped remote rank recovered without restarting the server, and a stop while the
model is being placed again that leaves nothing on any machine and logs no error."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import sys
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.multimachine.harness import Cluster
from tests.multimachine.inner.sharded import (
    PROMPTS,
    alive,
    answer,
    blas_of,
    client_for,
    endless,
    health,
    measure,
    rank0,
    ranks,
    secrets_in_listings,
    served_again,
    sharded_server,
    stop_while_placing,
)
from tests.server.serverproc import stop


def test_pipeline_over_machines(cluster: Cluster, tmp_path: Path, demo_tokenizer: Any) -> None:
    m1, m2, m3 = cluster.machines
    with sharded_server(cluster, tmp_path, "pipeline") as (base, proc):
        client = client_for(base)
        for prompt in PROMPTS:
            assert answer(client, "split", prompt) == answer(client, "plain", prompt)
        reference = answer(client, "plain", PROMPTS[0])
        (peer, machine), first = next(iter(ranks(cluster).items())), ranks(cluster)
        assert len(first) == 1 and machine is m2  # m1 + the first machine that answers
        assert cluster.machine_of(rank0(cluster)) is m1 and m1.inode() != m2.inode()
        assert blas_of(peer) == blas_of(rank0(cluster)) == "openblas"
        assert not secrets_in_listings(cluster), secrets_in_listings(cluster)
        eos = sorted(demo_tokenizer("qwen3").eos_token_ids)
        for how in (signal.SIGKILL, signal.SIGSTOP):
            victim = next(iter(ranks(cluster)))
            lost_rank_recovers(client, base, victim, how, eos, reference)
            assert not alive(victim)
            assert all(m is m2 for m in ranks(cluster).values())  # m2 answers: used again
        assert not secrets_in_listings(cluster), secrets_in_listings(cluster)
        stop_while_placing(cluster, base, lambda: stop(proc))
    assert not m3.pids() or m3.pids() == [m3.sshd.pid if m3.sshd else -1]


def lost_rank_recovers(
    client: Any, base: str, victim: int, how: int, eos: list[int], reference: Any
) -> None:
    chunks = endless(client, eos)
    for _ in range(3):
        next(chunks)
    lost = time.monotonic()
    os.kill(victim, how)
    with pytest.raises(openai.APIError) as caught:  # the in-protocol error event
        for _ in chunks:
            pass
    name = signal.Signals(how).name
    measure(f"{name}: error event after", time.monotonic() - lost)
    assert "sharded model failed" in str(caught.value) or "stopped" in str(caught.value)
    status, seconds = health(base)
    assert status == 503
    measure(f"{name}: /health answered 503 in", seconds)
    assert answer(client, "plain", PROMPTS[0]) == reference  # the other model serves
    measure(f"{name}: served again after", served_again(client, reference) - lost)


PLACE = """
import sys
from pathlib import Path
from pipeserve.config.models import ShardingOptions
from pipeserve.engine.sharding.group import SSH_OPTIONS
from pipeserve.engine.sharding.placement import place
from pipeserve.errors import PlacementError
options = ShardingOptions(strategy="pipeline", hostfile=sys.argv[1])
try:
    print("placed", place(options, Path(sys.argv[2]), SSH_OPTIONS)[1].ranks)
except PlacementError as exc:
    print("refused", exc)
"""


def test_placement_checks_each_machines_memory(
    cluster: Cluster, tmp_path: Path, demo_model_dir: Any
) -> None:
    """The placement's ssh probe reads every machine's MemAvailable: the demo model fits;
    one whose layers (safetensors header: 1 PiB each) fit nowhere is refused with the
    memory each rank needs and what each machine has."""
    m1 = cluster.machines[0]
    hosts = cluster.hostfile(cluster.machines, tmp_path / "hosts.json")
    huge = tmp_path / "huge"
    huge.mkdir()
    shutil.copy(demo_model_dir("qwen3") / "config.json", huge / "config.json")
    header = {f"model.layers.{i}.w": {"dtype": "F32", "shape": [1 << 48],
              "data_offsets": [i << 50, (i + 1) << 50]} for i in range(2)}  # fmt: skip
    text = json.dumps(header).encode()
    (huge / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text)

    def place_in_m1(model_dir: Path) -> str:
        argv = [sys.executable, "-c", PLACE, str(hosts), str(model_dir)]
        done = m1.run(argv, env=cluster.env(), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert place_in_m1(demo_model_dir("qwen3")) == "placed 2"
    refused = place_in_m1(huge)
    assert refused.startswith("refused cannot place the model on 3 of 3 machines"), refused
    assert "not enough memory: 2 ranks need 1073741824 MiB each" in refused, refused
    assert all(f"{m.name} " in refused.split("available:")[1] for m in cluster.machines)
