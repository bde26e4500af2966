"""The quantized matmul kernel alone, on a decode step's shapes: SmolLM2-135M's 210
4-bit linears (group 32, float16 scales) and its 8-bit tied output projection.

    python benchmarks/qmm_bench.py [--rows 1,2,4,8,16] [--repeat 20] [--rounds 3]
        [--against OTHER_BUILD.so] [--this BUILD.so]

Random weights quantized by MLX (the kernel's cost does not depend on the values), all
211 products of one step in one graph, as a decode step issues them; milliseconds per
step for each number of activation rows M, and for the output projection alone.
`--against` loads a second build of the extension (another commit's
`$PIPESERVE_HOME/cpu-kernels/<key>/_pipeserve_cpu*.so`) into the same process and
alternates the two, round by round, so the ratio is measured under the same load;
`--this` measures a given build instead of this tree's own (cpu_kernels.kernels()).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

HIDDEN, INTERMEDIATE, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152
LINEARS = [  # (out, in) of one layer's q, k, v, o, gate, up, down
    (HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),
    (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE),
]  # fmt: skip

Weights = tuple[mx.array, mx.array, mx.array, int, int]  # w, scales, biases, group, bits


def quantized(shape: tuple[int, int], bits: int, seed: int) -> Weights:
    w, scales, biases = mx.quantize(mx.random.normal(shape, key=mx.random.key(seed)), 32, bits)
    return w, scales.astype(mx.float16), biases.astype(mx.float16), 32, bits


def model_weights() -> tuple[list[Weights], Weights]:
    layers = [quantized(s, 4, i) for i, s in enumerate(LINEARS * LAYERS)]
    head = quantized((VOCAB, HIDDEN), 8, 999)
    mx.eval([a for w in [*layers, head] for a in w[:3]])
    return layers, head


def step_ms(ext: Any, weights: list[Weights], rows: int, repeat: int) -> float:
    inputs = {k: mx.random.normal((rows, k)) for k in (HIDDEN, INTERMEDIATE)}
    mx.eval(list(inputs.values()))

    def step() -> None:
        mx.eval([ext.affine_qmm(inputs[w[0].shape[1] * 32 // w[4]], *w) for w in weights])

    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(repeat):
        step()
    return (time.perf_counter() - start) / repeat * 1e3


def load_build(path: Path) -> Any:
    from pipeserve.engine.cpu_kernels import thread_count
    from pipeserve.engine.cpu_kernels.build import import_module

    other = import_module(path)
    other.set_threads(thread_count())
    return other


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--against", type=Path, help="another build's .so to alternate with")
    parser.add_argument("--this", type=Path, help="a build's .so instead of this tree's")
    args = parser.parse_args()
    from pipeserve.engine import cpu_kernels

    ext = load_build(args.this) if args.this else cpu_kernels.kernels()
    if ext is None:
        sys.exit("the CPU kernels are not available here")
    builds = {"this": ext} | ({"other": load_build(args.against)} if args.against else {})
    layers, head = model_weights()
    print(f"{ext.simd()}, {ext.threads()} threads; ms per step (median of {args.rounds} rounds)")
    for rows in [int(r) for r in args.rows.split(",")]:
        times: dict[str, list[float]] = {f"{b} {part}": [] for b in builds for part in "ah"}
        for _ in range(args.rounds):
            for name, build in builds.items():
                times[f"{name} a"].append(step_ms(build, [*layers, head], rows, args.repeat))
                times[f"{name} h"].append(step_ms(build, [head], rows, args.repeat))
        line = [f"M={rows:3d}"]
        for name in builds:
            all_ms, head_ms = (statistics.median(times[f"{name} {p}"]) for p in "ah")
            line.append(f"{name}: all {all_ms:6.2f}  head {head_ms:5.2f}")
        if "other" in builds:
            ratio = statistics.median(times["other a"]) / statistics.median(times["this a"])
            line.append(f"other/this {ratio:4.2f}x")
        print("   ".join(line), flush=True)


if __name__ == "__main__":
    main()
