"""Decode throughput with and without a grammar constraint, side by side in one run.

Runs pipeserve's MLX engine in process on a model (default: the qwen3 demo model) and
decodes batches of 1 and 8 sequences of --tokens tokens each, at temperature 1.0,
free or constrained by a JSON schema that cannot end before --tokens (an array of at
least 100 nested objects with patterns, enums and ranges: steady-state JSON, like a
long structured answer), or with `--grammar text` by the grammar of a strict tool
under tool_choice auto while the model writes free text (nearly every token allowed:
the mask's worst case, paid by every answer token of such a request). Rounds
alternate free / constrained, so load changes on a shared machine hit both; prints the
median aggregate tok/s per cell and the ratio, and the same for CPU time per token
(throughput ratio as free CPU / constrained CPU).

    python benchmarks/structured_bench.py [--model demo:qwen3] [--tokens 96] [--rounds 5]
    python benchmarks/structured_bench.py --model bench:small   # the 116M serving shape
    python benchmarks/structured_bench.py --grammar text        # free text under strict tools
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from pipeserve.config.models import EngineOptions
from pipeserve.constraint import Envelope
from pipeserve.engine.base import GenerationJob
from pipeserve.engine.runtime import build_mlx_engine
from pipeserve.engine.sampling.grammar import GrammarCompiler
from pipeserve.engine.weights.loader import (
    eos_token_ids,
    load_tokenizer,
    read_config,
    resolve_source,
)
from pipeserve.events import TokenText
from pipeserve.request import OutputFormat, SamplingParams, ToolSpec
from pipeserve.stages.grammar_plan import response_grammar
from pipeserve.stages.toolfmt.call_grammar import auto_call_plan
from pipeserve.stages.toolfmt.json_format import JsonParams

ITEM: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "status": {"enum": ["open", "closed", "pending"]},
        "owner": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 8},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 3},
    },
    "required": ["id", "status", "owner", "tags"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 100}


def bench_grammar(kind: str, compiler: GrammarCompiler) -> str:
    if kind == "text":
        tool = ToolSpec(
            "lookup", "", {"type": "object", "properties": {"q": {"type": "string"}}}, True
        )
        plan = auto_call_plan(JsonParams(format="json"), [tool], None, False, single=False)
        assert plan is not None
        return plan.build(compiler)
    return response_grammar(compiler, OutputFormat("json_schema", SCHEMA), Envelope(), False)


def model_dir(source: str) -> Path:
    if source.startswith("bench:"):
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_models import build_bench_model

        return build_bench_model(source.split(":", 1)[1], Path(".bench-models"))
    return resolve_source(source)


def run_round(
    engine: Any,
    compiler: GrammarCompiler | None,
    grammar: str,
    batch: int,
    tokens: int,
    eos: frozenset[int],
) -> tuple[float, float]:
    """(aggregate decode tok/s, this process's CPU ms per token) of one batch, from the
    first token to the last. CPU time counts every thread (MLX, llguidance's mask
    threads) and is less sensitive than wall time to other jobs on a shared machine."""
    jobs = [
        GenerationJob(
            request_id=f"b{i}",
            prompt_token_ids=[10, 20, 30 + i],
            sampling=SamplingParams(temperature=1.0),
            max_tokens=tokens,
            stop_token_ids=eos,
            constraint=compiler.constraint(grammar) if compiler is not None else None,
        )
        for i in range(batch)
    ]
    streams = [engine.submit(job) for job in jobs]
    first: float | None = None
    cpu = 0.0
    count = 0
    for stream in streams:
        for event in stream:
            if isinstance(event, TokenText):
                if first is None:
                    first, cpu = time.perf_counter(), time.process_time()
                count += 1
    assert first is not None
    return (count - 1) / (time.perf_counter() - first), (time.process_time() - cpu) * 1e3 / (
        count - 1
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo:qwen3")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--grammar", choices=("schema", "text"), default="schema")
    args = parser.parse_args()
    path = model_dir(args.model)
    tokenizer = load_tokenizer(path)
    eos = eos_token_ids(tokenizer, path)
    compiler = GrammarCompiler(tokenizer, read_config(path).get("vocab_size"), eos)
    grammar = bench_grammar(args.grammar, compiler)
    engine = build_mlx_engine("bench", path, tokenizer, EngineOptions(max_batch=8))
    try:
        run_round(engine, compiler, grammar, 1, 8, eos)  # warm up: compile, caches
        print(
            f"model {args.model}, grammar {args.grammar}, {args.tokens} tokens per sequence, "
            f"{args.rounds} rounds"
        )
        print(
            "| batch | free tok/s | constrained tok/s | ratio | CPU ms/token free, constrained | ratio |"
        )
        print("|---|---|---|---|---|---|")
        for batch in (int(b) for b in args.batches.split(",")):
            free, bound = [], []
            for _ in range(args.rounds):
                free.append(run_round(engine, None, grammar, batch, args.tokens, eos))
                bound.append(run_round(engine, compiler, grammar, batch, args.tokens, eos))
            f, b = (statistics.median(r[0] for r in rs) for rs in (free, bound))
            fc, bc = (statistics.median(r[1] for r in rs) for rs in (free, bound))
            print(
                f"| {batch} | {f:.1f} | {b:.1f} | {b / f:.2f} | {fc:.1f}, {bc:.1f} | {fc / bc:.2f} |"
            )
    finally:
        engine.close()


if __name__ == "__main__":
    main()
