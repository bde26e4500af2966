"""Under gevent monkey patching the engine runs on a real OS thread: the hub stays free."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    from gevent import monkey

    monkey.patch_all()

    import json
    import time

    import gevent

    from pipeserve.engine.output.channel import gevent_patched
    from pipeserve.engine.runtime import build_runtime
    from tests.engine.helpers import entry, job

    assert gevent_patched()
    runtime = build_runtime(entry("demo:qwen3"))
    prompt = runtime.tokenizer.encode("Once upon a time", add_special_tokens=False)
    ticks = []
    done = False

    def ticker():
        while not done:
            ticks.append(time.monotonic())
            gevent.sleep(0.005)

    def generate(max_tokens):
        stream = runtime.engine.submit(job(prompt, max_tokens=max_tokens))
        kind = type(stream.channel._queue).__module__
        return kind, [getattr(e, "token_id", None) for e in stream if type(e).__name__ == "TokenText"]

    tick = gevent.spawn(ticker)
    gevent.sleep(0.05)
    started = time.monotonic()
    workers = [gevent.spawn(generate, n) for n in (120, 120, 120, 100)]
    gevent.joinall(workers, raise_error=True)
    elapsed = time.monotonic() - started
    done = True
    tick.join()
    runtime.engine.close()
    during = [t for t in ticks if t >= started]
    gaps = [b - a for a, b in zip(during, during[1:])]
    print(json.dumps({
        "queues": sorted({w.value[0] for w in workers}),
        "outputs": [w.value[1] for w in workers],
        "ticks": len(during),
        "max_gap": max(gaps),
        "elapsed": elapsed,
    }))
    """
)


def test_hub_keeps_running_while_generating(pipeserve_home, demo_model_dir):
    demo_model_dir("qwen3")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(_repo()),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(q.startswith("gevent") for q in result["queues"]), result["queues"]
    outputs = result["outputs"]
    assert [len(o) for o in outputs] == [120, 120, 120, 100]
    assert outputs[0] == outputs[1] == outputs[2] and outputs[3] == outputs[0][:100]
    # Generating on the hub would stall the ticker for the whole run: it must keep
    # ticking while the four requests decode (a count, not a time bound).
    summary = {k: v for k, v in result.items() if k != "outputs"}
    assert result["ticks"] >= 10, summary
    assert result["ticks"] >= 10, summary
    print(summary)


def _repo():
    from pathlib import Path

    return Path(__file__).resolve().parents[3]
