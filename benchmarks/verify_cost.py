"""What a speculative verification pass costs: a decode step of W tokens per row against
one of 1 token, at several batch sizes, in-process on the engine's model layout and cache
(mlx-lm's BatchKVCache, CPU kernels where they apply). Each width is timed interleaved
with the others, so background load hits them alike; medians.

    python benchmarks/verify_cost.py --shape smollm2 --batches 1 2 4 8 --widths 1 2 4 8 16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serve_bench import CODER, bench_model
from pipeserve.engine.weights.loader import load_model
from pipeserve.settings import pipeserve_home


def step_seconds(model: Any, cache: list[Any], batch: int, width: int) -> float:
    """One forward pass of `width` tokens per row and the argmax of every position (what
    a greedy verification reads), then the cache trimmed back."""
    feed = mx.array([[11] * width] * batch, dtype=mx.uint32)
    started = time.perf_counter()
    logits = model(feed, cache=cache)
    mx.eval(mx.argmax(logits if width > 1 else logits[:, -1], axis=-1))
    elapsed = time.perf_counter() - started
    for layer in cache:
        layer.trim(width)
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shape", default="smollm2", choices=["small", "qwen3-0.6b", "smollm2", CODER]
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--context", type=int, default=400, help="tokens already cached")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    model_dir, _ = bench_model(args.shape, pipeserve_home())
    model = load_model(model_dir, "auto", cpu_pretranspose=True)
    print(f"{model_dir.name}; context {args.context}; load {os.getloadavg()[0]:.1f}")
    for batch in args.batches:
        cache = [BatchKVCache([0] * batch) for _ in model.layers]
        mx.eval(model(mx.array([list(range(7, 7 + args.context))] * batch), cache=cache))
        for width in args.widths * 2:  # warm-up
            step_seconds(model, cache, batch, width)
        times: dict[int, list[float]] = {w: [] for w in args.widths}
        for _ in range(args.repeats):
            for width in args.widths:
                times[width].append(step_seconds(model, cache, batch, width))
        base = statistics.median(times[args.widths[0]])
        cells = [f"W{w} {statistics.median(times[w]) / base:.2f}x" for w in args.widths]
        print(f"batch {batch}: W{args.widths[0]} {base * 1e3:.1f} ms; " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
