"""pipeserve vs mlx_lm.server, side by side in one run (ratios, not absolute times).

    python benchmarks/serve_bench.py [--shape small|qwen3-0.6b|smollm2] [--tokens 48] [--rounds 5]
        [--blas-threads 1] [--out-of-box] [--in-process]

Builds a random-weight Qwen3-architecture fp32 model offline (or, with --shape smollm2,
takes the shipped default model's converted GGUF folder, Q4_1 weights) and serves it with
pipeserve and with mlx_lm.server on 127.0.0.1, both up for the whole run with OpenBLAS
preloaded and the same OPENBLAS_NUM_THREADS. Rounds alternate between the servers (the
idle one is paused with SIGSTOP, the order flips each round); a round is one stream
(time to first token, decode tok/s) then 1, 4 and 8 concurrent streams (aggregate
tok/s). Prints the medians, pipeserve/mlx_lm ratios and the range of per-round ratios,
and pipeserve's prefix cache effect on a repeated long prompt. --out-of-box repeats it
with each server as installed; --in-process adds `mlx_lm.stream_generate`'s decode rate.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_models import CODER_PIPELINE, build_bench_model, fetch_coder_model
from servers import (
    BenchServer,
    bench_environment,
    plain_environment,
    start_mlx_lm,
    start_pipeserve,
)

from pipeserve.settings import pipeserve_home

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Write a long story about a lighthouse keeper and the sea."
_tags = itertools.count()


def fresh_prompt() -> str:
    """PROMPT behind a tag no earlier request had: no prompt-cache hit on either server
    beyond the chat template's first tokens."""
    return f"[{next(_tags)}] {PROMPT}"


def stream_once(base: str, model: str, max_tokens: int, prompt: str = PROMPT) -> dict[str, float]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first = last = None
    chunks = 0
    tokens = 0
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                tokens = data["usage"].get("completion_tokens", 0)
            delta = (data.get("choices") or [{}])[0].get("delta", {})
            if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
                now = time.perf_counter()
                first = first or now
                last = now
                chunks += 1
    tokens = tokens or chunks
    first = first or time.perf_counter()
    last = last or first
    decode = (tokens - 1) / (last - first) if tokens > 1 and last > first else 0.0
    return {
        "ttft": first - started,
        "decode": decode,
        "tokens": tokens,
        "total": time.perf_counter() - started,
    }


def aggregate(base: str, model: str, streams: int, max_tokens: int) -> float:
    results: list[dict[str, float]] = []
    threads = [
        threading.Thread(
            target=lambda i=i: results.append(stream_once(base, model, max_tokens, fresh_prompt()))
        )
        for i in range(streams)
    ]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(r["tokens"] for r in results) / (time.perf_counter() - started)


COLUMNS = ("ttft", "decode", "agg1", "agg4", "agg8")


def measure(server: BenchServer, kind: str, tokens: int) -> dict[str, float]:
    """One measurement: "single" is one stream (time to first token, decode tok/s),
    "aggN" N concurrent streams (aggregate tok/s)."""
    if kind == "single":
        single = stream_once(server.base, server.model, tokens, fresh_prompt())
        return {"ttft": single["ttft"], "decode": single["decode"]}
    return {kind: aggregate(server.base, server.model, int(kind.removeprefix("agg")), tokens)}


def prefix_ratio(server: BenchServer) -> float:
    """TTFT of a repeated long prompt over its first (pipeserve's prefix cache)."""
    long_prompt = "The history of lighthouses. " * 150
    cold = stream_once(server.base, server.model, 4, long_prompt)["ttft"]
    warm = stream_once(server.base, server.model, 4, long_prompt)["ttft"]
    return warm / cold


def alternate(
    servers: list[BenchServer], args: argparse.Namespace
) -> dict[str, list[dict[str, float]]]:
    """Rounds over every server, one measured at a time while the others are paused.
    Each measurement runs on every server back to back before the next one starts (so
    the two halves of a ratio are seconds apart), and the order flips each round."""
    rounds: dict[str, list[dict[str, float]]] = {s.name: [] for s in servers}
    for server in servers:  # warm-up, then paused until its turn
        stream_once(server.base, server.model, 8)
        server.pause()
    for r in range(args.rounds):
        row: dict[str, dict[str, float]] = {s.name: {} for s in servers}
        for kind in ("single", "agg1", "agg4", "agg8"):
            for server in servers if r % 2 == 0 else servers[::-1]:
                with server.active():
                    row[server.name].update(measure(server, kind, args.tokens))
        for name, values in row.items():
            rounds[name].append(values)
        print(f"  round {r + 1}/{args.rounds} done (load {os.getloadavg()[0]:.1f})", flush=True)
    return rounds


def start_servers(
    args: argparse.Namespace, model_dir: Path, pipeline: str, env: dict[str, str], work: Path
) -> list[BenchServer]:
    options = {"max_batch": 8, "queue_size": 64}
    servers = [start_pipeserve(model_dir, work, env, {**options, "dtype": "auto"}, pipeline)]
    if args.shape == "smollm2":  # also with the weights as stored (mlx_lm.server's layout)
        quantized = {**options, "dtype": "quantized"}
        servers.append(
            start_pipeserve(model_dir, work, env, quantized, pipeline, name="pipeserve (q)")
        )
    servers.append(start_mlx_lm(model_dir, work, env))
    return servers


def in_process_decode(
    model_dir: Path, tokens: int, env: dict[str, str], pretranspose: bool = False
) -> float:
    """mlx_lm.stream_generate's decode rate; with `pretranspose`, on the weight layout
    pipeserve's engine uses (so served/in-process is the HTTP + pipeline overhead)."""
    code = (
        "import sys, time, mlx_lm\n"
        "from pipeserve.engine.cpu_kernels.transposed import pretranspose_dense_weights\n"
        f"m, t = mlx_lm.load({str(model_dir)!r})\n"
        f"if {pretranspose}: pretranspose_dense_weights(m)\n"
        f"p = t.apply_chat_template([{{'role': 'user', 'content': {PROMPT!r}}}], add_generation_prompt=True)\n"
        "rates = []\n"
        "for _ in range(3):\n"
        f"    last = None\n"
        f"    for r in mlx_lm.stream_generate(m, t, p, max_tokens={tokens}): last = r\n"
        "    rates.append(last.generation_tps)\n"
        "print(sorted(rates)[1])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="small", choices=["small", "qwen3-0.6b", "smollm2"])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--blas-threads",
        default="1",
        help="OPENBLAS_NUM_THREADS for every server ('' = OpenBLAS's default)",
    )
    parser.add_argument("--out-of-box", action="store_true", help="also each server as installed")
    parser.add_argument("--in-process", action="store_true", help="also mlx_lm.stream_generate")
    args = parser.parse_args()
    home = pipeserve_home()
    model_dir, pipeline = bench_model(args.shape, home)
    work = Path(tempfile.mkdtemp(prefix="pipeserve-bench-"))
    openblas_env = bench_environment(home, args.blas_threads)
    settings = [(f"same BLAS (OpenBLAS, {args.blas_threads or 'default'} thread(s))", openblas_env)]
    if args.out_of_box:
        settings.append(("as installed", plain_environment()))
    print(
        f"model: {model_dir.name} ({args.shape}); {args.tokens} tokens per stream; "
        f"median of {args.rounds} alternating rounds; load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    for label, env in settings:
        servers = start_servers(args, model_dir, pipeline, env, work)
        try:
            rounds = alternate(servers, args)
            with servers[0].active():
                prefix = prefix_ratio(servers[0])
        finally:
            for server in servers:
                server.stop()
        print_table(f"{label}; load {os.getloadavg()[0]:.1f} at the end", rounds)
        print(f"pipeserve repeated long prompt TTFT / first TTFT: {prefix:.2f}")
    if args.in_process:
        rate = in_process_decode(model_dir, args.tokens * 2, openblas_env)
        print(f"\nin-process mlx_lm.stream_generate decode (OpenBLAS): {rate:.1f} tok/s")
        rate = in_process_decode(model_dir, args.tokens * 2, openblas_env, pretranspose=True)
        print(
            f"the same on pipeserve's CPU weight layout (options.cpu_pretranspose): {rate:.1f} tok/s"
        )
    return 0


CODER = "qwen2.5-coder-0.5b"  # a real model that does spec_bench's edit (bench_models.py)


def bench_model(shape: str, home: Path) -> tuple[Path, str]:
    """(model folder, pipeline) of a benchmark shape."""
    if shape == CODER:
        return fetch_coder_model(home), CODER_PIPELINE
    if shape != "smollm2":
        return build_bench_model(shape, home / "bench"), "qwen3"
    from pipeserve.config import load_server_config
    from pipeserve.engine.weights.loader import resolve_source

    entry = load_server_config(REPO / "configs" / "default.yaml").config.models[0]
    return resolve_source(entry.source, entry.sha256), entry.pipeline


def print_table(label: str, rounds: dict[str, list[dict[str, float]]]) -> None:
    """Medians per server, then each pipeserve server's ratio to mlx_lm.server: of the
    medians, and the median and range of the per-round ratios (the two halves of each
    measured back to back)."""
    medians = {
        name: {c: statistics.median(r[c] for r in rows) for c in COLUMNS}
        for name, rows in rounds.items()
    }
    print(f"\n## {label}")
    print(f"{'server':<22}" + "".join(f"{c:>12}" for c in COLUMNS))
    for name, row in medians.items():
        print(f"{name:<22}" + "".join(f"{row[c]:>12.3f}" for c in COLUMNS))
    peer = "mlx_lm.server"
    for name in [n for n in rounds if n != peer]:
        ratios = {c: medians[name][c] / medians[peer][c] for c in COLUMNS}
        print(
            f"{'ratio ' + name + ' / peer':<22}" + "".join(f"{ratios[c]:>12.2f}" for c in COLUMNS)
        )
        paired = {
            c: [p[c] / m[c] for p, m in zip(rounds[name], rounds[peer]) if m[c]] for c in COLUMNS
        }
        print(
            f"{'  median of rounds':<22}"
            + "".join(f"{statistics.median(paired[c]):>12.2f}" for c in COLUMNS)
        )
        spans = [f"{min(paired[c]):.2f}-{max(paired[c]):.2f}" for c in COLUMNS]
        print(f"{'  rounds range':<22}" + "".join(f"{s:>12}" for s in spans))


if __name__ == "__main__":
    raise SystemExit(main())
