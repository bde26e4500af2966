"""Bursts: N new requests at once, pipeserve served vs mlx-lm's in-process prefill.

    python benchmarks/burst_bench.py [--bursts 8,32,64] [--lengths 1,8,16,24,32] [--rounds 3]

The model is the qwen3 demo model (real Qwen vocabulary and tokenizer, hidden size 64,
2 layers): a decode step costs a few ms on the CPU, so what a burst costs besides
decoding (admission, prefill, retirement) is visible. Both sides run with OpenBLAS
preloaded; rounds alternate between the server and the in-process reference (the idle
server is paused with SIGSTOP) and each cell is the median of the rounds.

For each burst size N, every request carries a unique tag (no prefix-cache hits), and
one burst is sent per output length (max_tokens = each of --lengths), streamed:
- TTFT: the burst of the first length (1 by default): each request's time to its first
  output chunk (p50 / p90 / max).
- fixed cost: what a burst costs besides its steady decode steps (requests in,
  admission, prefill, retirement, responses out), wall = fixed + steps x step. The step
  is measured in each burst: the median interval between consecutive tokens of a stream
  (served: as the client receives them; in-process: between `next()` calls after the
  last first token). Three estimates, medians over rounds with their range:
  "fixed s": the first (1-token) burst's wall time less one step (the round's step
  time from its longer bursts): the fewest steps subtracted, so the least noise;
  "in-burst": each longer burst's wall time less its steps x its own step;
  "fit": a least-squares line through each round's (steps, wall time) points.
  The last two subtract many steps and swing with the load when the step is long, as
  the reference's is (its logsumexp over batch x vocabulary).
The reference is mlx-lm's BatchGenerator in one process (prefill batch and completion
batch = N) on the same prompt tokens, timed the same way.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from servers import bench_environment, start_pipeserve

from pipeserve.engine.weights.demo.build import ensure_demo_model
from pipeserve.settings import pipeserve_home

REPO = Path(__file__).resolve().parents[1]
TOPICS = ("a lighthouse keeper", "a clockmaker", "the tides", "a mountain road", "old maps")


def prompt(i: int, tag: str) -> str:
    """A chat message of about 40 tokens, unique per request (no prefix-cache hits)."""
    topic = TOPICS[i % len(TOPICS)]
    return f"[{tag}-{i}] Write a short story about {topic} and the sea, in plain words, for a child who likes boats."


def post(port: int, body: dict) -> list[float]:
    """One streamed chat request: when each chunk carrying output arrived (s after
    the request was sent); the last entry is when the stream ended."""
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
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
    arrivals = []
    for line in response:
        if line.startswith(b"data: {") and has_output(json.loads(line[6:])):
            arrivals.append(time.perf_counter() - started)
    conn.close()
    return [*arrivals, time.perf_counter() - started]


def has_output(chunk: dict) -> bool:
    delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"))


def served_burst(port: int, n: int, max_tokens: int, tag: str) -> dict[str, float]:
    arrivals: list[list[float]] = [[] for _ in range(n)]
    barrier = threading.Barrier(n + 1)

    def one(i: int) -> None:
        body = {
            "model": "bench",
            "messages": [{"role": "user", "content": prompt(i, tag)}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
        barrier.wait()
        arrivals[i] = post(port, body)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    gaps = [b - a for times in arrivals for a, b in zip(times[:-2], times[1:-1])]
    steps = max(len(times) - 1 for times in arrivals)  # output chunks: one per step
    return summarize([times[0] for times in arrivals], wall, steps, gaps)


def summarize(
    latencies: list[float], wall: float, steps: int, gaps: list[float]
) -> dict[str, float]:
    """TTFT percentiles, and the fixed cost measured in the burst itself: wall time less
    steps x the median interval between a stream's tokens (its steady step time)."""
    ordered = sorted(latencies)
    step = statistics.median(gaps) if gaps else float("nan")
    return {
        "p50": statistics.median(ordered),
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "max": ordered[-1],
        "wall": wall,
        "steps": steps,
        "step": step,
        "fixed": wall - steps * step,
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
    first, done, steps, ticks = {{}}, {{}}, {{}}, []
    while len(done) < n:
        _, responses = gen.next()
        now = time.perf_counter() - started
        if responses:
            ticks.append(now)
        for r in responses:
            first.setdefault(r.uid, now)
            steps[r.uid] = steps.get(r.uid, 0) + 1
            if r.finish_reason is not None:
                done[r.uid] = now
    gen.close()
    started_all = max(first.values())
    gaps = [b - a for a, b in zip(ticks, ticks[1:]) if a >= started_all]
    return [first[u] for u in uids], max(done.values()), max(steps.values()), gaps

burst(8, 2, "warm")
for n in {bursts!r}:
    for max_tokens in {lengths!r}:
        latencies, wall, steps, gaps = burst(n, max_tokens, f"{{max_tokens}}-{{n}}-{tag}")
        out[f"{{n}}-{{max_tokens}}"] = {{"latencies": latencies, "wall": wall, "steps": steps, "gaps": gaps}}
print(json.dumps(out))
"""


def in_process(model_dir: Path, args: argparse.Namespace, env: dict[str, str], tag: str) -> dict:
    code = IN_PROCESS.format(
        bench_dir=str(Path(__file__).resolve().parent),
        model_dir=str(model_dir),
        bursts=args.bursts,
        lengths=args.lengths,
        tag=tag,
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800
    )
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    raw = json.loads(result.stdout.strip().splitlines()[-1])
    return {k: summarize(v["latencies"], v["wall"], v["steps"], v["gaps"]) for k, v in raw.items()}


def served_round(port: int, args: argparse.Namespace, tag: str) -> dict[str, dict[str, float]]:
    out = {}
    for n in args.bursts:
        for max_tokens in args.lengths:
            out[f"{n}-{max_tokens}"] = served_burst(port, n, max_tokens, f"{max_tokens}-{n}-{tag}")
    return out


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (steps, wall) points."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0
    return mean_y - slope * mean_x, slope


def fixed_costs(rounds: list[dict], n: int, lengths: list[int]) -> list[tuple[float, float]]:
    """Per round: (fixed s, s per step) of the N-burst, fitted over its output lengths."""
    return [
        fit_line([(r[f"{n}-{k}"]["steps"], r[f"{n}-{k}"]["wall"]) for k in lengths]) for r in rounds
    ]


def short_fixed(rounds: list[dict], n: int, lengths: list[int]) -> list[float]:
    """Per round: wall time of the burst of the first length less that many steps of the
    round's step time (the median token interval of its longer bursts). The fewer the
    steps subtracted, the less their noise weighs on the result."""
    first, longer = lengths[0], [k for k in lengths if k > lengths[0]]
    out = []
    for r in rounds:
        step = statistics.median(r[f"{n}-{k}"]["step"] for k in longer)
        out.append(r[f"{n}-{first}"]["wall"] - first * step)
    return out


def report(served: list[dict], reference: list[dict], args: argparse.Namespace) -> None:
    first, longer = args.lengths[0], [k for k in args.lengths if k > 1]
    print(
        f"\n{'N':>4} {'side':<10} {'TTFT p50':>9} {'p90':>7} {'max':>7} {'fixed s':>8} "
        f"{'(range)':>11} {'in-burst':>9} {'(range)':>12} {'fit':>7} {'step ms':>8}"
    )
    for n in args.bursts:
        cells = {}
        for side, rounds in (("pipeserve", served), ("mlx-lm", reference)):
            ttft = median_rows(rounds)[f"{n}-{first}"]
            short = short_fixed(rounds, n, args.lengths)
            bursts = [r[f"{n}-{k}"] for r in rounds for k in longer]
            in_burst = [b["fixed"] for b in bursts]
            fit = statistics.median(f for f, _ in fixed_costs(rounds, n, args.lengths))
            step = statistics.median(b["step"] for b in bursts)
            cells[side] = (ttft["p50"], statistics.median(short), statistics.median(in_burst), fit)
            print(
                f"{n:>4} {side:<10} {ttft['p50']:>9.3f} {ttft['p90']:>7.3f} {ttft['max']:>7.3f} "
                f"{statistics.median(short):>8.3f} {span(short):>11} "
                f"{statistics.median(in_burst):>9.3f} {span(in_burst):>12} {fit:>7.3f} "
                f"{step * 1000:>8.1f}"
            )
        p, m = cells["pipeserve"], cells["mlx-lm"]
        print(
            f"{n:>4} {'ratio p/m':<10} {ratio(p[0], m[0]):>9} {'':>7} {'':>7} "
            f"{ratio(p[1], m[1]):>8} {'':>11} {ratio(p[2], m[2]):>9} {'':>12} {ratio(p[3], m[3]):>7}"
        )


def span(values: list[float]) -> str:
    return f"{min(values):.2f}..{max(values):.2f}"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "n/a"


def median_rows(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {
        key: {f: statistics.median(r[key][f] for r in rounds) for f in rounds[0][key]}
        for key in rounds[0]
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bursts", default="8,32,64")
    parser.add_argument(
        "--lengths",
        default="1,8,16,24,32",
        help="output lengths (max_tokens), one burst each; the first gives the TTFT figures",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--blas-threads",
        default="1",
        help="OPENBLAS_NUM_THREADS for both sides ('' = OpenBLAS's default); on a shared "
        "2-core machine OpenBLAS's spinning threads made steps 2-4x slower and noisier",
    )
    args = parser.parse_args()
    args.bursts = [int(x) for x in args.bursts.split(",")]
    args.lengths = [int(x) for x in args.lengths.split(",")]
    model_dir = ensure_demo_model("qwen3")
    work = Path(tempfile.mkdtemp(prefix="pipeserve-burst-"))
    env = bench_environment(pipeserve_home(), args.blas_threads)
    options = {"max_batch": max(args.bursts), "queue_size": 256}
    server = start_pipeserve(model_dir, work, env, options)
    served, reference = [], []
    try:
        served_burst(server.port, 8, 2, "warm")
        server.pause()
        for r in range(args.rounds):
            with server.active():
                served.append(served_round(server.port, args, f"r{r}"))
            reference.append(in_process(model_dir, args, env, f"r{r}"))
            print(f"  round {r + 1}/{args.rounds} (load {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        server.stop()
    print(
        f"model: demo qwen3 ({model_dir}); OpenBLAS for both; median of {args.rounds} "
        f"alternating rounds; lengths {args.lengths}; load {os.getloadavg()[0]:.1f}; "
        f"OPENBLAS_NUM_THREADS={args.blas_threads or 'default'}"
    )
    report(served, reference, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
