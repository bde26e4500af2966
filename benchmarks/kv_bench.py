"""A quantized KV cache (`options.kv_cache`) against the float one, on the shipped
SmolLM2-135M (or any model source with --source), in one process.

    python benchmarks/kv_bench.py [--rounds 3] [--tokens 64] [--streams 8]
        [--context 1024] [--contexts 256,1024,2048] [--budget-mib 64] [--group-size 64]
        [--check-tokens 64] [--speed-only]

Three engines of the same model: float KV (float32 on the CPU), 8 bits and 4 bits
(--group-size). Reported:

1. Agreement: each reference prompt (the SmolLM2 reference test's four and cpu_bench's
   four, chat-templated), greedy, --check-tokens tokens with no stop, all prompts in one
   batch per engine: how many leading tokens each quantized engine shares with float;
   then teacher-forced on float's answers, as one prompt and one decode step at a time.
2. KV bytes per token, from the arrays: a --context-token prompt through the model with
   each engine's own per-layer caches (mlx-lm's KVCache; pipeserve's quantized row
   caches), their `nbytes` over the positions they hold (--context a multiple of 256, the
   caches' allocation step: no slack); and the prefix cache's entry for one answered
   request (exactly sized) over its tokens, as the engine holds it.
3. What fits a fixed KV budget (--budget-mib): the longest context of one stream, and
   how many streams of --context tokens, from the measured bytes per token.
4. Decode speed, alternating the engines' order each round: one stream after a prompt
   of each of --contexts tokens (decode tok/s from its first to last token), and
   --streams concurrent streams on short prompts (aggregate tok/s from submission,
   prefills included, and the batch's decode rate alone). Prefix cache off (no hits). Each engine's layer steps on the CPU kernels' one-op path (fused_layers'
   ONE_OP_STEPS: float or quantized cache) are counted, to show which path decoded.
Say the machine's load (printed) with the numbers; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

REFERENCE_PROMPTS = [  # tests/engine/weights/test_smollm2_reference.py, benchmarks/cpu_bench.py
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle works, part by part.",
    "Describe a walk through a busy market in the morning.",
    "Tell me about the history of paper, from its invention to today.",
]
MODES: list[tuple[str, int | None]] = [("float", None), ("8-bit", 8), ("4-bit", 4)]


def default_source() -> tuple[str, str | None]:
    from pipeserve.config import load_server_config

    entry = load_server_config(REPO / "configs" / "default.yaml").config.models[0]
    return entry.source, entry.sha256


def build(source: str, sha256: str | None, bits: int | None, args: argparse.Namespace) -> Any:
    from pipeserve.config.models import EngineOptions, ModelEntry, PrefixCacheOptions
    from pipeserve.engine.runtime import build_runtime

    kv = None if bits is None else {"bits": bits, "group_size": args.group_size}
    options = EngineOptions(
        dtype="auto",
        max_batch=max(args.streams, len(REFERENCE_PROMPTS)),
        kv_cache=kv,
        prefix_cache=PrefixCacheOptions(enabled=False),
    )
    entry = ModelEntry(name="m", source=source, sha256=sha256, pipeline="chatml", options=options)
    return build_runtime(entry)


def job(ids: list[int], tokens: int) -> Any:
    from pipeserve.engine.base import GenerationJob
    from pipeserve.request import SamplingParams

    return GenerationJob("bench", ids, SamplingParams(temperature=0.0), tokens, frozenset())


def chat(tokenizer: Any, text: str) -> list[int]:
    ids: list[int] = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    return ids


def token_ids(stream: Any) -> list[int]:
    from pipeserve.events import TokenText

    return [e.token_id for e in stream if isinstance(e, TokenText)]


def agreement(engines: dict[str, Any], tokens: int) -> list[list[int]]:
    tokenizer = engines["float"].tokenizer
    prompts = [chat(tokenizer, p) for p in REFERENCE_PROMPTS]
    out = {}
    for name, runtime in engines.items():
        streams = [runtime.engine.submit(job(p, tokens)) for p in prompts]
        out[name] = [token_ids(s) for s in streams]
    print(
        f"\n1. greedy agreement with float KV ({tokens} tokens, {len(prompts)} prompts, one batch)"
    )
    for name in engines:
        if name == "float":
            continue
        shared = [common_prefix(a, b) for a, b in zip(out["float"], out[name])]
        full32 = sum(n >= 32 for n in shared)
        print(f"   {name}: leading tokens equal per prompt {shared}; {full32}/{len(shared)}"
              f" prompts identical for the first 32")  # fmt: skip
        for i, n in enumerate(shared):
            if n < tokens:
                print(f"     prompt {i}: float ...{tokenizer.decode(out['float'][i][n : n + 6])!r}"
                      f" vs {name} ...{tokenizer.decode(out[name][i][n : n + 6])!r}")  # fmt: skip
    return [p + ids for p, ids in zip(prompts, out["float"])]


def forced_agreement(engines: dict[str, Any], sequences: list[list[int]], tokens: int,
                     args: argparse.Namespace) -> None:  # fmt: skip
    """Teacher-forced: each float answer fed through the model with float and with
    quantized caches; how often the quantized caches' next-token argmax is float's, and
    how far the logits move (greedy runs diverge at the first near-tie and never meet
    again; this counts every position). Twice: the answer as one prompt (MLX's attention
    over the cache), and its tokens one decode step at a time (the CPU kernels' one-op
    layer where it applies)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from pipeserve.config.models import KvCacheOptions
    from pipeserve.engine.kv.quantized import RowCaches
    from pipeserve.engine.weights.loader import load_model

    model = load_model(engines["float"].model_dir, "auto", True)

    def logits(seq: list[int], bits: int | None, stepwise: bool) -> mx.array:
        options = None if bits is None else KvCacheOptions(bits=bits, group_size=args.group_size)
        caches = RowCaches(model, options)() or make_prompt_cache(model)
        if not stepwise:
            out = model(mx.array([seq]), cache=caches)[0, -tokens - 1 : -1]
            mx.eval(out)
            return out
        mx.eval(model(mx.array([seq[: -tokens - 1]]), cache=caches))
        rows = []
        for token in seq[-tokens - 1 : -1]:
            rows.append(model(mx.array([[token]]), cache=caches)[0, -1])
            mx.eval(rows[-1])
        return mx.stack(rows)

    print(f"   teacher-forced on float's answers ({len(sequences)} x {tokens} positions):")
    for stepwise in (False, True):
        print("     as one prompt:" if not stepwise else "     one decode step per token:")
        reference = [logits(seq, None, stepwise) for seq in sequences]
        for name, bits in MODES[1:]:
            same = total = 0
            worst = 0.0
            for seq, ref in zip(sequences, reference):
                got = logits(seq, bits, stepwise)
                same += int((mx.argmax(got, -1) == mx.argmax(ref, -1)).sum().item())
                total += ref.shape[0]
                worst = max(worst, mx.abs(got - ref).max().item())
            print(f"       {name}: next token = float's at {same}/{total} positions"
                  f" ({same / total:.1%}); largest logit change {worst:.2f}")  # fmt: skip


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def bytes_per_token(engines: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from pipeserve.config.models import KvCacheOptions
    from pipeserve.engine.kv.quantized import RowCaches
    from pipeserve.engine.weights.loader import load_model

    folder = engines["float"].model_dir
    model = load_model(folder, "auto", True)
    ids = mx.array([[(i * 7919) % 4000 + 100 for i in range(args.context)]])
    print(
        f"\n2. KV bytes per token (a {args.context}-token prompt through the model; its caches' arrays)"
    )
    found: dict[str, float] = {}
    for name, bits in MODES:
        options = None if bits is None else KvCacheOptions(bits=bits, group_size=args.group_size)
        caches = RowCaches(model, options)() or make_prompt_cache(model)
        mx.eval(model(ids, cache=caches))
        held = sum(c.nbytes for c in caches)
        found[name] = held / args.context
        print(f"   {name}: {held / args.context:,.0f} B/token ({held / 2**20:.1f} MiB for"
              f" {args.context}), {held / args.context / (found['float']):.3f} of float")  # fmt: skip
    return found


def prefix_entry_bytes(source: str, sha: str | None, args: argparse.Namespace) -> None:
    from pipeserve.config.models import EngineOptions, ModelEntry
    from pipeserve.engine.runtime import build_runtime

    print("   prefix-cache entries of one answered request (as the engine stores them):")
    float_held = 0
    for name, bits in MODES:
        kv = None if bits is None else {"bits": bits, "group_size": args.group_size}
        entry = ModelEntry(name="m", source=source, sha256=sha, pipeline="chatml",
                           options=EngineOptions(dtype="auto", kv_cache=kv))  # fmt: skip
        runtime = build_runtime(entry)
        try:
            prompt = chat(runtime.tokenizer, REFERENCE_PROMPTS[4] * 4)
            token_ids(runtime.engine.submit(job(prompt, 16)))
            held = runtime.engine.stats()["prefix_cache_bytes"]
            float_held = float_held or held
            print(f"     {name}: {held:,} B, {held / float_held:.3f} of float")
        finally:
            runtime.engine.close()


def budget(per_token: dict[str, float], args: argparse.Namespace) -> None:
    limit = args.budget_mib * 2**20
    print(f"\n3. in a KV budget of {args.budget_mib} MiB")
    for name, bpt in per_token.items():
        print(f"   {name}: longest context of one stream {int(limit // bpt):,} tokens;"
              f" streams of {args.context} tokens: {int(limit // (bpt * args.context))}")  # fmt: skip


def single(runtime: Any, ids: list[int], tokens: int) -> float:
    from pipeserve.events import TokenText

    stream = runtime.engine.submit(job(ids, tokens))
    stamps = [time.perf_counter() for e in stream if isinstance(e, TokenText)]
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def multi(runtime: Any, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """(aggregate tok/s from submission, prefills included; the batch's decode tok/s:
    the first stream's first-to-last token rate x the streams, which decode in step)."""
    from pipeserve.events import TokenText

    start = time.perf_counter()
    streams = [runtime.engine.submit(job(ids, tokens)) for ids in prompts]
    stamps = [time.perf_counter() for e in streams[0] if isinstance(e, TokenText)]
    count = len(stamps) + sum(len(token_ids(s)) for s in streams[1:])
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) * len(prompts)
    return count / (time.perf_counter() - start), decode


def speed(engines: dict[str, Any], args: argparse.Namespace) -> None:
    from pipeserve.engine.cpu_kernels.fused_layers import ONE_OP_STEPS

    tokenizer = engines["float"].tokenizer
    story = " ".join(REFERENCE_PROMPTS) + " "
    contexts = [int(c) for c in args.contexts.split(",")]
    kinds = [f"@{c}" for c in contexts] + ["multi", "batch"]
    results: dict[str, dict[str, list[float]]] = {n: {k: [] for k in kinds} for n in engines}
    steps: dict[str, dict[str, int]] = {n: {"float": 0, "quantized": 0} for n in engines}
    names = list(engines)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            runtime = engines[name]
            head = f"Round {r} {name}. "  # distinct prompts each run
            text = chat(tokenizer, head + story * 200)
            short = [chat(tokenizer, f"{head}Stream {i}: {REFERENCE_PROMPTS[i % 8]}")
                     for i in range(args.streams)]  # fmt: skip
            before = dict(ONE_OP_STEPS)
            for c in contexts:
                results[name][f"@{c}"].append(single(runtime, text[: c - args.tokens], args.tokens))
            total, decode = multi(runtime, short, args.tokens)
            results[name]["multi"].append(total)
            results[name]["batch"].append(decode)
            for kind in steps[name]:
                steps[name][kind] += ONE_OP_STEPS[kind] - before.get(kind, 0)
    print(f"\n4. decode tok/s, median of {args.rounds} alternating rounds (per round values)")
    base = {k: statistics.median(v) for k, v in results["float"].items()}
    for name in names:
        print(f"   {name} (one-op layer steps: {steps[name]['float']} float cache,"
              f" {steps[name]['quantized']} quantized cache):")  # fmt: skip
        for kind in kinds:
            values = results[name][kind]
            label = {
                "multi": f"{args.streams} streams (aggregate, prefills included)",
                "batch": f"{args.streams} streams (the batch's decode steps only)",
            }.get(kind, f"one stream at ~{kind[1:]} context")
            median = statistics.median(values)
            print(f"     {label}: {median:.1f} ({median / base[kind]:.2f}x) {fmt(values)}")


def fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.1f}" for v in values) + "]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", help="model source (default: configs/default.yaml's)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--contexts", default="256,1024,2048", help="decode speed contexts")
    parser.add_argument("--speed-only", action="store_true", help="part 4 only")
    parser.add_argument("--budget-mib", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--check-tokens", type=int, default=64)
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args()
    source, sha = (args.source, None) if args.source else default_source()
    print(f"model {source}; kv group size {args.group_size}; load {os.getloadavg()}")
    engines = {name: build(source, sha, bits, args) for name, bits in MODES}
    try:
        if not args.speed_only:
            answers = agreement(engines, args.check_tokens)
            forced_agreement(engines, answers, args.check_tokens, args)
            per_token = bytes_per_token(engines, args)
            prefix_entry_bytes(source, sha, args)
            budget(per_token, args)
        if not args.skip_speed:
            speed(engines, args)
    finally:
        for runtime in engines.values():
            runtime.engine.close()
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
