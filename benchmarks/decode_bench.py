"""Decode step at batch N: pipeserve's engine batch vs mlx-lm's BatchGenerator, in-process.

    python benchmarks/decode_bench.py [--batch 64] [--steps 24] [--rounds 3] [--shape demo|small]

Both run greedy decoding of the same N prompts in one process with OpenBLAS preloaded:
mlx-lm's BatchGenerator on the model as `mlx_lm.load` returns it, and pipeserve's
`Scheduler` (what the engine thread runs each step: mlx-lm's generator plus pipeserve's
admission policy, detokenization and event delivery) on the model as pipeserve loads it
(`options.cpu_pretranspose`, the CPU weight layout). After every request has started,
`--steps` steady-state steps are timed; rounds alternate and the median is reported.
The tokens both produce are compared: greedy output must be identical.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHILD = "PIPESERVE_DECODE_BENCH_CHILD"


def burst_prompts(tokenizer, n: int) -> list[list[int]]:
    from burst_bench import prompt

    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt(i, "decode")}], add_generation_prompt=True
        )
        for i in range(n)
    ]


def time_mlx_lm(model, prompts: list[list[int]], steps: int) -> tuple[float, list[list[int]]]:
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    n = len(prompts)
    gen = BatchGenerator(
        model,
        completion_batch_size=n,
        prefill_batch_size=n,
        stream=mx.default_stream(mx.default_device()),
    )
    uids = gen.insert(prompts, max_tokens=[steps + 8] * n)
    tokens: dict[int, list[int]] = {u: [] for u in uids}
    while not all(tokens.values()):  # prefill until every sequence has its first token
        for r in gen.next()[1]:
            tokens[r.uid].append(r.token)
    started = time.perf_counter()
    for _ in range(steps):
        for r in gen.next()[1]:
            tokens[r.uid].append(r.token)
    elapsed = (time.perf_counter() - started) / steps
    gen.close()
    return elapsed, [tokens[u] for u in uids]


def time_pipeserve(model, tokenizer, prompts: list[list[int]], steps: int):
    from pipeserve.config.models import EngineOptions
    from pipeserve.engine.base import GenerationJob
    from pipeserve.engine.mlx.scheduler import Scheduler
    from pipeserve.engine.output.channel import Channel, Courier
    from pipeserve.engine.output.detokenize import Detokenizers
    from pipeserve.engine.output.request_state import RequestState
    from pipeserve.request import SamplingParams

    n = len(prompts)
    batch = Scheduler(model, EngineOptions(max_batch=n, prefix_cache={"enabled": False}), {})
    courier, detokenizers = Courier(), Detokenizers(tokenizer)
    seqs = []
    for key, p in enumerate(prompts):
        job = GenerationJob(f"r{key}", p, SamplingParams(temperature=0), steps + 8)
        seqs.append(RequestState(job, Channel(), detokenizers.new(), tokenizer))
        batch.add(key, seqs[-1], courier)
    while not all(s.completion_tokens for s in seqs):
        batch.step(courier)
        courier.flush()
    started = time.perf_counter()
    for _ in range(steps):
        batch.step(courier)
        courier.flush()
    elapsed = (time.perf_counter() - started) / steps
    ids = [
        [e.token_id for events in drain(s.channel) for e in events if hasattr(e, "token_id")]
        for s in seqs
    ]
    batch.close(courier)
    return elapsed, ids


def drain(channel) -> list:
    out = []
    while True:
        got = channel.get(0)
        if got is None:
            return out
        out.append(got)


def child(args: argparse.Namespace) -> None:
    import mlx_lm

    from pipeserve.blas import loaded_blas
    from pipeserve.engine.weights.loader import load_model

    model_dir = resolve_model(args.shape)
    reference, tokenizer = mlx_lm.load(str(model_dir))
    ours = load_model(model_dir, "auto", cpu_pretranspose=True)
    prompts = burst_prompts(tokenizer, args.batch)
    rows: dict[str, list[float]] = {"mlx-lm": [], "pipeserve": []}
    same = True
    for _ in range(args.rounds):
        t_ref, ids_ref = time_mlx_lm(reference, prompts, args.steps)
        t_ours, ids_ours = time_pipeserve(ours, tokenizer, prompts, args.steps)
        rows["mlx-lm"].append(t_ref)
        rows["pipeserve"].append(t_ours)
        n = min(len(ids_ref[0]), len(ids_ours[0]))
        same &= all(a[:n] == b[:n] for a, b in zip(ids_ref, ids_ours))
    ref, ours_ms = (statistics.median(rows[k]) * 1000 for k in ("mlx-lm", "pipeserve"))
    print(
        f"model {model_dir.name}; batch {args.batch}; {args.steps} steps x {args.rounds} "
        f"rounds; BLAS {loaded_blas()}, OPENBLAS_NUM_THREADS="
        f"{os.environ.get('OPENBLAS_NUM_THREADS', 'default')}; load {os.getloadavg()[0]:.1f}"
    )
    print(f"mlx-lm BatchGenerator step: {ref:.1f} ms  (rounds: {fmt(rows['mlx-lm'])})")
    print(f"pipeserve engine step:      {ours_ms:.1f} ms  (rounds: {fmt(rows['pipeserve'])})")
    print(f"speed-up: {ref / ours_ms:.2f}x; greedy tokens identical: {same}")


def fmt(values: list[float]) -> str:
    return ", ".join(f"{v * 1000:.1f}" for v in values)


def resolve_model(shape: str) -> Path:
    from pipeserve.engine.weights.demo.build import ensure_demo_model
    from pipeserve.settings import pipeserve_home

    if shape == "demo":
        return ensure_demo_model("qwen3")
    from bench_models import build_bench_model

    return build_bench_model(shape, pipeserve_home() / "bench")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shape", default="demo", choices=["demo", "small", "qwen3-0.6b"])
    parser.add_argument("--blas-threads", default="1")
    args = parser.parse_args()
    from servers import run_with_blas

    return run_with_blas(CHILD, args.blas_threads, lambda: child(args))


if __name__ == "__main__":
    raise SystemExit(main())
