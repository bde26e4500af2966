"""`server.workers: 1` vs `2` (one engine host for both workers): memory and throughput.

    python benchmarks/workers_bench.py [--shapes demo,small] [--streams 8] [--tokens 32] [--rounds 3]

For each model shape ("demo": the qwen3 demo model, a few MB; "small": the 116M fp32
shape of bench_models.py, 460 MB of weights):

1. Memory: starts pipeserve with workers: 1, sends 8 concurrent requests (so every
   worker and the engine host have served), sums PSS (/proc/<pid>/smaps_rollup) over the
   whole process tree (master, workers, engine host), stops it; the same with
   workers: 2. Only one server runs while its memory is read (PSS splits shared pages
   among every process that maps them, another server's too).
2. Throughput: both servers up, alternating rounds of N concurrent streams (greedy,
   `--tokens` each), aggregate tok/s per round, medians and the 2/1 ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_models import build_bench_model
from serve_bench import stream_once

from pipeserve.settings import pipeserve_home
from tests.server.serverproc import server_process

REPO = Path(__file__).resolve().parents[1]


def source_of(shape: str) -> str:
    if shape == "demo":
        return "demo:qwen3"
    return str(build_bench_model(shape, pipeserve_home() / "bench"))


def write_config(folder: Path, shape: str, workers: int, streams: int) -> Path:
    path = folder / f"{shape}-w{workers}.yaml"
    path.write_text(
        f"pipelines_dir: {REPO / 'pipelines'}\n"
        f"server: {{workers: {workers}}}\n"
        f"models:\n  - name: bench\n    source: '{source_of(shape)}'\n    pipeline: qwen3\n"
        f"    options: {{max_batch: {max(8, streams)}, queue_size: 64}}\n"
        "endpoints:\n  - {route: /v1/chat/completions, api: openai-chat}\n"
    )
    return path


def tree(root: int) -> list[int]:
    """root and all its descendants (from /proc/<pid>/stat's parent field)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def pss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


def role(pid: int, root: int) -> str:
    command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    if pid == root:
        return "master"
    if "pipeserve.server.remote.host" in command:
        return "engine host"
    if "pipeserve" in command and "serve" in command:
        return "worker"
    return command.split(" ")[0].rsplit("/", 1)[-1] or "other"


def burst(base: str, streams: int, tokens: int) -> float:
    """Aggregate completion tok/s of `streams` concurrent greedy streams."""
    prompts = [f"Story number {n} about the sea." for n in range(streams)]
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=streams) as pool:
        results = list(pool.map(lambda p: stream_once(base, "bench", tokens, p), prompts))
    return sum(r["tokens"] for r in results) / (time.perf_counter() - started)


def memory(folder: Path, shape: str, workers: int, streams: int) -> dict[str, int]:
    with server_process(write_config(folder, shape, workers, streams)) as (base, proc):
        burst(base, streams, 8)  # every worker and the host have served
        time.sleep(1.0)
        by_role: dict[str, int] = {}
        for pid in tree(proc.pid):
            try:
                name = role(pid, proc.pid)
                by_role[name] = by_role.get(name, 0) + pss_kib(pid)
            except OSError:  # exited meanwhile
                continue
    return by_role


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="demo,small")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/pipeserve-workers-bench"))
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes.split(","):
        weights = sum(
            p.stat().st_size for p in Path(source_of(shape).removeprefix("demo:")).glob("*.safetensors")
        ) if shape != "demo" else 0  # fmt: skip
        pss = {w: memory(args.folder, shape, w, args.streams) for w in (1, 2)}
        totals = {w: sum(parts.values()) for w, parts in pss.items()}
        print(f"\n## {shape}" + (f" ({weights / 2**20:.0f} MiB of weights)" if weights else ""))
        for w in (1, 2):
            parts = ", ".join(f"{k} {v / 1024:.0f}" for k, v in sorted(pss[w].items()))
            print(f"workers {w}: PSS of the tree {totals[w] / 1024:.0f} MiB ({parts})")
        print(f"extra for the second worker: {(totals[2] - totals[1]) / 1024:.0f} MiB")
        rates: dict[int, list[float]] = {1: [], 2: []}
        with ExitStack() as stack:
            bases = {
                w: stack.enter_context(
                    server_process(write_config(args.folder, shape, w, args.streams))
                )[0]
                for w in (1, 2)
            }
            for w in (1, 2):
                burst(bases[w], args.streams, 8)  # warm-up
            for _ in range(args.rounds):
                for w in (1, 2):
                    rates[w].append(burst(bases[w], args.streams, args.tokens))
        one, two = statistics.median(rates[1]), statistics.median(rates[2])
        print(f"{args.streams} streams x {args.tokens} tokens, tok/s per round: "
              f"w1 {[round(r, 1) for r in rates[1]]} w2 {[round(r, 1) for r in rates[2]]}")  # fmt: skip
        print(f"median aggregate: workers 1 {one:.1f} tok/s, workers 2 {two:.1f} tok/s, "
              f"ratio 2/1 {two / one:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
