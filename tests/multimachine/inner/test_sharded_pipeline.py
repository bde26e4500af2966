"""A pipeline-sharded model over machines: equal to unsharded, each rank on its own
machine with the same BLAS, the group's token in no process listing, a SIGKILLed and a
SIGSTOPped remote rank recovered without restarting the server, and a stop while the
model is being placed again that leaves nothing on any machine and logs no error."""

from __future__ import annotations

import os
import signal
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
