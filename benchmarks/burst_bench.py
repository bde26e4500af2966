"""Bursts: N new requests at once, pipeserve served vs mlx-lm's in-process prefill.

    python benchmarks/burst_bench.py [--bursts 8,32,64] [--short 8] [--long 40] [--rounds 3]

The model is the qwen3 demo model (real Qwen vocabulary and tokenizer, hidden size 64,
2 layers): a decode step costs a few ms on the CPU, so what a burst costs besides
decoding (admission, prefill in rounds, retirement) is visible. Both sides run with
OpenBLAS preloaded; rounds alternate between the server and the in-process reference
(the idle server is paused with SIGSTOP) and each cell is the median of the rounds.

For each burst size N, every request carries a unique tag (no prefix-cache hits):
- TTFT: N requests with max_tokens=1 sent at once; each one's latency is its time to
  first token (p50 / p90 / max) and the burst's wall time is when the last one ended.
- fixed cost: the wall time of a burst with `short` and with `long` output tokens;
  wall = fixed + steps x step time, solved from the two.
The reference is mlx-lm's BatchGenerator in one process (prefill batch and completion
batch = N) on the same prompt tokens, timed the same way.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeserve import blas
from pipeserve.engine.demo import ensure_demo_model, pipeserve_home
from tests.server.serverproc import free_port, stop

REPO = Path(__file__).resolve().parents[1]
TOPICS = ("a lighthouse keeper", "a clockmaker", "the tides", "a mountain road", "old maps")


def prompt(i: int, tag: str) -> str:
    """A chat message of about 40 tokens, unique per request (no prefix-cache hits)."""
    topic = TOPICS[i % len(TOPICS)]
    return f"[{tag}-{i}] Write a short story about {topic} and the sea, in plain words, for a child who likes boats."


def post(port: int, body: dict) -> tuple[float, int]:
    """One non-streaming chat request: (latency in s, completion tokens)."""
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    for attempt in range(50):
        try:
            conn.request(
                "POST",
                "/v1/chat/completions",
                json.dumps(body),
                {"Content-Type": "application/json"},
            )
            break
        except ConnectionError:
            conn.close()
            time.sleep(0.05 * (attempt + 1))
    response = conn.getresponse()
    data = json.loads(response.read())
    conn.close()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {data}")
    return time.perf_counter() - started, int(data["usage"]["completion_tokens"])


def served_burst(port: int, n: int, max_tokens: int, tag: str) -> dict[str, float]:
    latencies: list[float] = [0.0] * n
    tokens: list[int] = [0] * n
    barrier = threading.Barrier(n + 1)

    def one(i: int) -> None:
        body = {
            "model": "bench",
            "messages": [{"role": "user", "content": prompt(i, tag)}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        barrier.wait()
        latencies[i], tokens[i] = post(port, body)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    return summarize(latencies, time.perf_counter() - started, max(tokens))


def summarize(latencies: list[float], wall: float, steps: int) -> dict[str, float]:
    ordered = sorted(latencies)
    return {
        "p50": statistics.median(ordered),
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "max": ordered[-1],
        "wall": wall,
        "steps": steps,
    }


IN_PROCESS = r"""
import json, sys, time
import mlx.core as mx
import mlx_lm
from mlx_lm.generate import BatchGenerator
sys.path.insert(0, {bench_dir!r})
from burst_bench import prompt

model, tokenizer = mlx_lm.load({model_dir!r})
out = {{}}

def burst(n, max_tokens, tag):
    prompts = [tokenizer.apply_chat_template([{{"role": "user", "content": prompt(i, tag)}}],
               add_generation_prompt=True) for i in range(n)]
    gen = BatchGenerator(model, completion_batch_size=n, prefill_batch_size=n, stream=mx.default_stream(mx.default_device()))
    started = time.perf_counter()
    uids = gen.insert(prompts, max_tokens=[max_tokens] * n)
    first, done, steps = {{}}, {{}}, {{}}
    while len(done) < n:
        _, responses = gen.next()
        now = time.perf_counter() - started
        for r in responses:
            first.setdefault(r.uid, now)
            steps[r.uid] = steps.get(r.uid, 0) + 1
            if r.finish_reason is not None:
                done[r.uid] = now
    gen.close()
    return [first[u] for u in uids], max(done.values()), max(steps.values())

burst(8, 2, "warm")
for n in {bursts!r}:
    for kind, max_tokens in (("ttft", 1), ("short", {short}), ("long", {long})):
        latencies, wall, steps = burst(n, max_tokens, f"{{kind}}-{{n}}-{tag}")
        out[f"{{n}}-{{kind}}"] = {{"latencies": latencies, "wall": wall, "steps": steps}}
print(json.dumps(out))
"""


def in_process(model_dir: Path, args: argparse.Namespace, env: dict[str, str], tag: str) -> dict:
    code = IN_PROCESS.format(
        bench_dir=str(Path(__file__).resolve().parent),
        model_dir=str(model_dir),
        bursts=args.bursts,
        short=args.short,
        long=args.long,
        tag=tag,
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800
    )
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    raw = json.loads(result.stdout.strip().splitlines()[-1])
    return {k: summarize(v["latencies"], v["wall"], v["steps"]) for k, v in raw.items()}


def start_server(model_dir: Path, max_batch: int, env: dict[str, str], work: Path) -> tuple:
    port = free_port()
    config = work / "burst.yaml"
    config.write_text(
        f"pipelines_dir: {REPO / 'pipelines'}\n"
        f"models:\n  - name: bench\n    source: {model_dir}\n    pipeline: qwen3\n"
        f"    options: {{max_batch: {max_batch}, queue_size: 256}}\n"
        "endpoints:\n  - {route: /v1/chat/completions, api: openai-chat}\n"
    )
    log = work / "pipeserve.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeserve.cli",
            "serve",
            "--config",
            str(config),
            "--port",
            str(port),
        ],
        env=env,
        cwd=REPO,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(log.read_text()[-3000:])
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, port
        except OSError:
            time.sleep(0.3)
    stop(proc)
    raise RuntimeError("pipeserve did not start")


def served_round(port: int, args: argparse.Namespace, tag: str) -> dict[str, dict[str, float]]:
    out = {}
    for n in args.bursts:
        for kind, max_tokens in (("ttft", 1), ("short", args.short), ("long", args.long)):
            out[f"{n}-{kind}"] = served_burst(port, n, max_tokens, f"{kind}-{n}-{tag}")
    return out


def fixed_cost(short: dict[str, float], long: dict[str, float]) -> tuple[float, float]:
    """(fixed seconds, seconds per step) from wall = fixed + steps x step."""
    step = (long["wall"] - short["wall"]) / max(1, long["steps"] - short["steps"])
    return max(0.0, short["wall"] - short["steps"] * step), step


def median_rows(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {
        key: {f: statistics.median(r[key][f] for r in rounds) for f in rounds[0][key]}
        for key in rounds[0]
    }


def report(served: dict, reference: dict, args: argparse.Namespace) -> None:
    print(
        f"\n{'N':>4} {'side':<12} {'TTFT p50':>9} {'p90':>7} {'max':>7} "
        f"{'fixed s':>8} {'step ms':>8} {'wall short':>10} {'wall long':>9}"
    )
    for n in args.bursts:
        rows = {}
        for side, data in (("pipeserve", served), ("mlx-lm", reference)):
            ttft, short, long = (data[f"{n}-{k}"] for k in ("ttft", "short", "long"))
            fixed, step = fixed_cost(short, long)
            rows[side] = (ttft["p50"], fixed)
            print(
                f"{n:>4} {side:<12} {ttft['p50']:>9.3f} {ttft['p90']:>7.3f} {ttft['max']:>7.3f} "
                f"{fixed:>8.3f} {step * 1000:>8.1f} {short['wall']:>10.3f} {long['wall']:>9.3f}"
            )
        (pt, pf), (mt, mf) = rows["pipeserve"], rows["mlx-lm"]
        print(
            f"{n:>4} {'ratio p/m':<12} {pt / mt:>9.2f} {'':>7} {'':>7} {pf / mf if mf else float('nan'):>8.2f}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bursts", default="8,32,64")
    parser.add_argument("--short", type=int, default=8)
    parser.add_argument("--long", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--blas-threads",
        default="1",
        help="OPENBLAS_NUM_THREADS for both sides ('' = OpenBLAS's default); on a shared "
        "2-core machine OpenBLAS's spinning threads made steps 2-4x slower and noisier",
    )
    args = parser.parse_args()
    args.bursts = [int(x) for x in args.bursts.split(",")]
    home = pipeserve_home()
    model_dir = ensure_demo_model("qwen3")
    work = Path(tempfile.mkdtemp(prefix="pipeserve-burst-"))
    base_env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.MARKER)}
    env = {**base_env, **(blas.openblas_environment(home) or {})}
    if args.blas_threads:
        env["OPENBLAS_NUM_THREADS"] = args.blas_threads
    proc, port = start_server(model_dir, max(args.bursts), env, work)
    served, reference = [], []
    try:
        served_burst(port, 8, 2, "warm")
        for r in range(args.rounds):
            served.append(served_round(port, args, f"r{r}"))
            os.killpg(proc.pid, signal.SIGSTOP)
            try:
                reference.append(in_process(model_dir, args, env, f"r{r}"))
            finally:
                os.killpg(proc.pid, signal.SIGCONT)
    finally:
        stop(proc)
    print(
        f"model: demo qwen3 ({model_dir}); OpenBLAS for both; median of {args.rounds} "
        f"alternating rounds; short={args.short} long={args.long} tokens; load "
        f"{os.getloadavg()[0]:.1f}; OPENBLAS_NUM_THREADS={args.blas_threads or 'default'}"
    )
    report(median_rows(served), median_rows(reference), args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
