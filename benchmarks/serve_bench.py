"""pipeserve vs mlx_lm.server, side by side in one run (ratios, not absolute times).

    python benchmarks/serve_bench.py [--shape small|qwen3-0.6b|smollm2] [--tokens 48] [--rounds 2]

Builds a random-weight Qwen3-architecture fp32 model offline (or, with --shape smollm2,
takes the shipped default model's converted GGUF folder, Q4_1 weights), then for each BLAS
setting ("same": both servers with OpenBLAS preloaded; "as installed": each server as
it starts out of the box) serves it with pipeserve and with mlx_lm.server on
127.0.0.1, alternating, each with a warm-up request, and prints: time to first token,
single-stream decode tok/s, aggregate tok/s at 1, 4 and 8 concurrent streams, and the
pipeserve/mlx_lm ratios; plus pipeserve's streaming decode rate over in-process
`mlx_lm.stream_generate` and the prefix cache's effect on a repeated long prompt.
"""

from __future__ import annotations

import argparse
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

from bench_models import build_bench_model

from pipeserve import blas
from pipeserve.engine.demo import pipeserve_home
from tests.server.serverproc import free_port, stop

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Write a long story about a lighthouse keeper and the sea."


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
            target=lambda i=i: results.append(
                stream_once(base, model, max_tokens, f"{PROMPT} #{i}")
            )
        )
        for i in range(streams)
    ]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(r["tokens"] for r in results) / (time.perf_counter() - started)


def start(cmd: list[str], env: dict[str, str], port: int, log: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=REPO,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited: {log.read_text()[-3000:]}")
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    stop(proc)
    raise RuntimeError(f"{cmd} did not start")


def pipeserve_cmd(
    model_dir: Path, port: int, work: Path, max_batch: int = 8, pipeline: str = "qwen3",
    dtype: str = "auto",
) -> list[str]:  # fmt: skip
    config = work / "bench.yaml"
    config.write_text(
        f"pipelines_dir: {REPO / 'pipelines'}\n"
        f"models:\n  - name: bench\n    source: {model_dir}\n    pipeline: {pipeline}\n"
        f"    options: {{max_batch: {max_batch}, queue_size: 64, dtype: {dtype}}}\n"
        "endpoints:\n  - {route: /v1/chat/completions, api: openai-chat}\n"
    )
    return [
        sys.executable,
        "-m",
        "pipeserve.cli",
        "serve",
        "--config",
        str(config),
        "--port",
        str(port),
    ]


def mlx_lm_cmd(model_dir: Path, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "mlx_lm.server",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


def measure_server(
    name: str,
    cmd: list[str],
    env: dict[str, str],
    port: int,
    model: str,
    args: argparse.Namespace,
    work: Path,
) -> dict[str, float]:
    proc = start(cmd, env, port, work / f"{name}.log")
    base = f"http://127.0.0.1:{port}"
    try:
        stream_once(base, model, 8)  # warm-up
        singles = [stream_once(base, model, args.tokens) for _ in range(args.rounds)]
        row = {
            "ttft": statistics.median(s["ttft"] for s in singles),
            "decode": statistics.median(s["decode"] for s in singles),
        }
        for n in (1, 4, 8):
            row[f"agg{n}"] = aggregate(base, model, n, args.tokens)
        if name.startswith("pipeserve"):
            long_prompt = "The history of lighthouses. " * 150
            cold = stream_once(base, model, 4, long_prompt)["ttft"]
            warm = stream_once(base, model, 4, long_prompt)["ttft"]
            row["prefix_ratio"] = warm / cold
        return row
    finally:
        stop(proc)


def in_process_decode(
    model_dir: Path, tokens: int, env: dict[str, str], pretranspose: bool = False
) -> float:
    """mlx_lm.stream_generate's decode rate; with `pretranspose`, on the weight layout
    pipeserve's engine uses (so served/in-process is the HTTP + pipeline overhead)."""
    code = (
        "import sys, time, mlx_lm\n"
        "from pipeserve.engine.cpu_layout import pretranspose_dense_weights\n"
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
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-out-of-box", action="store_true")
    args = parser.parse_args()
    home = pipeserve_home()
    model_dir, pipeline = bench_model(args.shape, home)
    work = Path(tempfile.mkdtemp(prefix="pipeserve-bench-"))
    base_env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.MARKER)}
    openblas_env = {**base_env, **(blas.openblas_environment(home) or {})}
    settings = [("same BLAS (OpenBLAS)", openblas_env, openblas_env)]
    if not args.skip_out_of_box:
        settings.append(("as installed", base_env, base_env))
    print(
        f"model: {model_dir.name} ({args.shape}); {args.tokens} tokens per stream; median of {args.rounds}"
    )
    for label, pipe_env, peer_env in settings:
        rows = {}
        port = free_port()
        cmd = pipeserve_cmd(model_dir, port, work, pipeline=pipeline)
        rows["pipeserve"] = measure_server("pipeserve", cmd, pipe_env, port, "bench", args, work)
        if args.shape == "smollm2":  # also with the weights as stored (mlx_lm.server's layout)
            port = free_port()
            cmd = pipeserve_cmd(model_dir, port, work, pipeline=pipeline, dtype="quantized")
            rows["pipeserve (q)"] = measure_server(
                "pipeserve-q", cmd, pipe_env, port, "bench", args, work
            )
        port = free_port()
        rows["mlx_lm.server"] = measure_server(
            "mlx_lm", mlx_lm_cmd(model_dir, port), peer_env, port, str(model_dir), args, work
        )
        print_table(label, rows)
    rate = in_process_decode(model_dir, args.tokens * 2, openblas_env)
    print(f"\nin-process mlx_lm.stream_generate decode (OpenBLAS): {rate:.1f} tok/s")
    rate = in_process_decode(model_dir, args.tokens * 2, openblas_env, pretranspose=True)
    print(f"the same on pipeserve's CPU weight layout (options.cpu_pretranspose): {rate:.1f} tok/s")
    return 0


def bench_model(shape: str, home: Path) -> tuple[Path, str]:
    """(model folder, pipeline) of a benchmark shape."""
    if shape != "smollm2":
        return build_bench_model(shape, home / "bench"), "qwen3"
    from pipeserve.config import load_server_config
    from pipeserve.engine.loader import resolve_source

    entry = load_server_config(REPO / "configs" / "default.yaml").config.models[0]
    return resolve_source(entry.source, entry.sha256), entry.pipeline


def print_table(label: str, rows: dict[str, dict[str, float]]) -> None:
    cols = ["ttft", "decode", "agg1", "agg4", "agg8"]
    print(f"\n## {label}")
    print(f"{'server':<16}" + "".join(f"{c:>10}" for c in cols))
    for name, row in rows.items():
        print(f"{name:<16}" + "".join(f"{row[c]:>10.3f}" for c in cols))
    m = rows["mlx_lm.server"]
    for name in [n for n in rows if n.startswith("pipeserve")]:
        p = rows[name]
        print(
            f"{'ratio' + name.removeprefix('pipeserve') + ' p/m':<16}"
            + "".join(f"{(p[c] / m[c] if m[c] else float('nan')):>10.2f}" for c in cols)
        )
    p = rows["pipeserve"]
    if "prefix_ratio" in p:
        print(f"pipeserve repeated long prompt TTFT / first TTFT: {p['prefix_ratio']:.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
