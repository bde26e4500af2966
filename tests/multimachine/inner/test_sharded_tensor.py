"""A tensor-sharded model over machines: equal to unsharded; a link cut mid-stream ends
the stream with an error event and the model serves again on the remaining machine; a
long cut of every other machine leaves the model unavailable (503 with the reason,
the other model serving, placement retries logged without tracebacks) until the links
return; no rank of a lost group survives."""

from __future__ import annotations

import os
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
    client_for,
    endless,
    health,
    log_since,
    log_size,
    measure,
    ranks,
    served_again,
    sharded_server,
    stop_cleanly,
    wait_until,
)
from tests.server.serverproc import stop

LONG_CUT = float(os.environ.get("PIPESERVE_LONG_CUT_SECONDS", "40"))


@pytest.mark.timeout(300 + 2 * LONG_CUT)
def test_tensor_over_machines(cluster: Cluster, tmp_path: Path, demo_tokenizer: Any) -> None:
    m1, m2, m3 = cluster.machines
    with sharded_server(cluster, tmp_path, "tensor") as (base, proc):
        client = client_for(base)
        for prompt in PROMPTS:
            assert answer(client, "split", prompt) == answer(client, "plain", prompt)
        reference = answer(client, "plain", PROMPTS[0])
        ((old, machine),) = ranks(cluster).items()
        assert machine is m2
        eos = sorted(demo_tokenizer("qwen3").eos_token_ids)

        # m2's link cut mid-stream: error event, 503, then the model on m1 + m3
        chunks = endless(client, eos)
        for _ in range(3):
            next(chunks)
        cut = time.monotonic()
        m2.cut()
        with pytest.raises(openai.APIError):
            for _ in chunks:
                pass
        measure("link cut: error event after", time.monotonic() - cut)
        polls = [health(base) for _ in range(5)]
        assert all(status == 503 for status, _ in polls), polls
        measure("link cut: slowest /health", max(seconds for _, seconds in polls))
        measure("link cut: served again after", served_again(client, reference) - cut)
        assert [m.name for m in ranks(cluster).values() if m is not m2] == [m3.name]
        m2.restore()
        wait_until(lambda: not alive(old), "the cut-off rank on m2 did not exit", 120)
        measure("link cut: old rank on m2 gone after", time.monotonic() - cut)

        # every other machine cut for LONG_CUT seconds, then back
        ((old, _),) = ranks(cluster).items()
        m2.cut()
        m3.cut()
        cut, offset = time.monotonic(), log_size(base)
        slowest = 0.0
        try:
            wait_until(lambda: health(base)[0] == 503, "the loss went unnoticed", 120)
            measure("idle long cut: noticed after", time.monotonic() - cut)
            while time.monotonic() - cut < LONG_CUT:
                status, seconds = health(base)
                assert status == 503
                slowest = max(slowest, seconds)
                with pytest.raises(openai.APIStatusError) as refused:
                    answer(client, "split", PROMPTS[0])
                assert refused.value.status_code == 503 and "unavailable" in str(refused.value)
                assert answer(client, "plain", PROMPTS[0]) == reference
                time.sleep(2)
        finally:
            m2.restore()
            m3.restore()
        back = time.monotonic()
        retries = log_since(base, offset)  # a failed placement: one line, no traceback
        assert "is unavailable: cannot place the model" in retries and "Traceback" not in retries
        measure("long cut: slowest /health", slowest)
        measure(
            "long cut: served again after the links returned",
            served_again(client, reference) - back,
        )
        wait_until(lambda: not alive(old), "a rank of the old group survived", 120)
        assert old not in ranks(cluster)
        assert list(ranks(cluster).values()) == [m2]  # back, and first in the hosts file
        stop_cleanly(cluster, base, lambda: stop(proc))
