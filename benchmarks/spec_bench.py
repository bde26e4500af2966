"""Speculative decoding served: the same model with and without `options.speculative`.

Two pipeserve servers on one model (OpenBLAS preloaded for both), one measured at a
time while the other is paused, alternating in rounds (the order flips each round):

- edit: a ~300-token source file in the prompt, asked back with one name changed;
  single-stream decode tok/s (after the first token);
- edit+prediction: the same with Chat's `prediction` set to the original file (sent to
  the server with speculation; the other gets the plain request);
- chat: an open question (nothing to look up), greedy: decode tok/s;
- chat sampled: the same at temperature 0.8 with a seed (the same seed for both servers,
  so the same tokens): a small model's greedy story repeats its own sentences, which
  prompt lookup then proposes; a sampled one seldom does, the case where speculation
  must back off and cost nothing;
- edit x8: eight editing streams at once, aggregate tok/s.

Greedy decoding (or one seed), so both servers must produce the same text: each round
compares them (`same`: rounds whose texts were identical; edit x8 compares the eight
answers as a set). The table gives the medians and the median of the per-round ratios
(with / without), the acceptance seen per workload, and the load. Every request has a deadline and the whole run a budget: a server that
stops answering is reported (with its log's tail) and the rounds measured so far are
printed, never waited on forever.

    python benchmarks/spec_bench.py --shape smollm2 --rounds 3
    python benchmarks/spec_bench.py --spec '{method: prompt_lookup, max_batch: 8}'
    python benchmarks/spec_bench.py --dtype float32   # SmolLM2 dequantized to float32
    python benchmarks/spec_bench.py --shape qwen2.5-coder-0.5b   # a model that does the edit
    python benchmarks/spec_bench.py --source model.gguf --sha256 HEX --pipeline chatml

SmolLM2-135M does not do the edit (docs/speculative.md): on it the editing workloads
measure a model that copies parts of its prompt in another order. Qwen2.5-Coder-0.5B-
Instruct (`--shape qwen2.5-coder-0.5b`, fetched by bench_models.py) returns the file with
the change, so there they measure the edit itself. `--source` takes any other model (a
local .gguf, an mlx-lm folder, a `pypi:` source).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serve_bench import CODER, bench_model
from benchmarks.servers import BenchServer, bench_environment, start_pipeserve
from pipeserve.settings import pipeserve_home

SOURCE = """import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Item:
    name: str
    price: float
    quantity: int = 1
    tags: list[str] = field(default_factory=list)

    def total(self) -> float:
        return self.price * self.quantity


@dataclass
class Basket:
    items: list[Item] = field(default_factory=list)

    def add(self, item: Item) -> None:
        for existing in self.items:
            if existing.name == item.name:
                existing.quantity += item.quantity
                return
        self.items.append(item)

    def remove(self, name: str) -> None:
        self.items = [item for item in self.items if item.name != name]

    def total(self) -> float:
        return sum(item.total() for item in self.items)

    def tagged(self, tag: str) -> list[Item]:
        return [item for item in self.items if tag in item.tags]


def load_basket(path: Path) -> Basket:
    data = json.loads(path.read_text())
    basket = Basket()
    for entry in data["items"]:
        basket.add(Item(entry["name"], entry["price"], entry.get("quantity", 1)))
    return basket


def save_basket(basket: Basket, path: Path) -> None:
    data = {"items": [{"name": i.name, "price": i.price, "quantity": i.quantity}
                      for i in basket.items]}
    path.write_text(json.dumps(data, indent=2))
"""
EDIT = (
    "Here is a Python file:\n\n```python\n" + SOURCE + "```\n\n"
    "Rename the method `tagged` to `with_tag`. Reply with the whole file and nothing else."
)
CHAT = "Tell me a short story about a lighthouse keeper who finds a message in a bottle."
WORKLOADS = ("edit", "edit+prediction", "chat", "chat sampled", "edit x8")
SAMPLED = {"temperature": 0.8, "top_p": 0.95}
REQUEST_SECONDS = 240.0  # a request still streaming after this: the server is hung
CHUNK_SECONDS = 90.0  # nothing streamed for this long: likewise
_tags = iter(range(1, 1 << 30))


class Hung(Exception):
    """A server that did not answer in time (or failed a request)."""


@dataclass
class Answer:
    decode: float  # tok/s after the first token
    tokens: int
    text: str


def stream_once(
    base: str,
    prompt: str,
    max_tokens: int,
    prediction: str | None = None,
    tag: int | None = None,
    sampling: dict[str, Any] | None = None,
) -> Answer:
    body: dict[str, Any] = {
        "model": "bench",
        # A new tag at the end: the file's prefix is cached (as an agent's resent
        # context is), each answer decoded afresh.
        "messages": [{"role": "user", "content": f"{prompt} [{tag or next(_tags)}]"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(sampling or {}),
    }
    if prediction is not None:
        body["prediction"] = {"type": "content", "content": prediction}
    first = last = None
    parts: list[str] = []
    usage: dict[str, Any] = {}
    deadline = time.monotonic() + REQUEST_SECONDS
    timeout = httpx.Timeout(CHUNK_SECONDS, connect=10)
    try:
        with httpx.stream(
            "POST", f"{base}/v1/chat/completions", json=body, timeout=timeout
        ) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if time.monotonic() > deadline:
                    raise Hung(f"{base}: still streaming after {REQUEST_SECONDS:.0f} s")
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                usage = data.get("usage") or usage
                content = (data.get("choices") or [{}])[0].get("delta", {}).get("content")
                if content:
                    parts.append(content)
                    last = time.perf_counter()
                    first = first or last
    except httpx.HTTPError as exc:
        raise Hung(f"{base}: {type(exc).__name__}: {exc}") from exc
    tokens = usage.get("completion_tokens", 0)
    span = (last or 0) - (first or 0)
    decode = (tokens - 1) / span if tokens > 1 and span > 0 else 0.0
    return Answer(decode, tokens, "".join(parts))


def concurrent(base: str, streams: int, max_tokens: int, tags: list[int]) -> Answer:
    """`streams` editing streams at once: the aggregate tok/s, the answers in tag order."""
    results: dict[int, Answer] = {}
    errors: list[Exception] = []

    def one(tag: int) -> None:
        try:
            results[tag] = stream_once(base, EDIT, max_tokens, tag=tag)
        except Exception as exc:  # reported below, on the measuring thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(tag,), daemon=True) for tag in tags]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(REQUEST_SECONDS + 10)
    if errors or len(results) < streams:
        raise Hung(str(errors[0]) if errors else f"{base}: a stream did not end")
    rate = sum(r.tokens for r in results.values()) / (time.perf_counter() - started)
    return Answer(rate, 0, "\n---\n".join(results[tag].text for tag in tags))


def measure(server: BenchServer, workload: str, tokens: int, tags: list[int]) -> Answer:
    """One workload on one server; `tags` (one per stream) make the prompts of a round
    the same on both servers and new to each round."""
    if workload == "edit x8":
        return concurrent(server.base, 8, tokens, tags)
    prompt = CHAT if workload.startswith("chat") else EDIT
    # The server without `speculative` would still propose from a prediction: its
    # baseline is the same request without one.
    prediction = SOURCE if workload == "edit+prediction" and server.name == "with" else None
    sampling = {**SAMPLED, "seed": tags[0]} if workload == "chat sampled" else None
    return stream_once(server.base, prompt, tokens, prediction, tags[0], sampling)


def counters(server: BenchServer) -> tuple[float, float]:
    """(proposed, accepted) speculative tokens so far."""
    text = httpx.get(f"{server.base}/metrics", timeout=30).text

    def total(name: str) -> float:
        prefix = f"pipeserve_speculative_{name}_tokens_total{{"
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(prefix))  # fmt: skip

    return total("proposed"), total("accepted")


@dataclass
class Results:
    rates: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # server, workload
    loads: dict[str, list[float]] = field(default_factory=dict)  # workload: 1-min load
    proposed: dict[str, float] = field(default_factory=dict)
    accepted: dict[str, float] = field(default_factory=dict)
    same: dict[str, list[bool]] = field(default_factory=dict)  # workload: texts equal?

    def add(self, server: str, workload: str, rate: float) -> None:
        self.rates.setdefault(server, {}).setdefault(workload, []).append(rate)

    def table(self) -> str:
        lines = [f"{'workload':<17}{'without':>9}{'with':>9}{'ratio':>7}{'rounds':>12}"
                 f"{'accepted':>10}{'same':>6}{'load':>10}"]  # fmt: skip
        for workload in WORKLOADS:
            off = self.rates.get("without", {}).get(workload, [])
            on = self.rates.get("with", {}).get(workload, [])
            ratios = [b / a for a, b in zip(off, on) if a]
            if not ratios:
                continue
            proposed = self.proposed.get(workload, 0)
            share = f"{self.accepted.get(workload, 0) / proposed:.0%}" if proposed else "-"
            loads = self.loads.get(workload, [0.0])
            same = self.same.get(workload, [])
            lines.append(
                f"{workload:<17}{statistics.median(off):>9.1f}{statistics.median(on):>9.1f}"
                f"{statistics.median(ratios):>7.2f}{min(ratios):>6.2f}-{max(ratios):<5.2f}"
                f"{share:>10}{f'{sum(same)}/{len(same)}':>6}{min(loads):>5.1f}-{max(loads):<4.1f}"
            )
        return "\n".join(lines)


def run_rounds(servers: list[BenchServer], args: argparse.Namespace, results: Results) -> None:
    """Alternating rounds until done or out of budget; raises Hung."""
    budget_end = time.monotonic() + args.budget
    for r in range(args.rounds):
        for workload in args.workloads:
            if time.monotonic() > budget_end:
                print(f"  out of the {args.budget:.0f} s budget: stopping", flush=True)
                return
            tags = [next(_tags) for _ in range(8)]
            texts: dict[str, str] = {}
            for server in servers if r % 2 == 0 else servers[::-1]:
                with server.active():
                    before = counters(server) if server.name == "with" else None
                    answer = measure(server, workload, args.tokens, tags)
                    results.add(server.name, workload, answer.decode)
                    texts[server.name] = answer.text
                    if before is not None:
                        after = counters(server)
                        results.proposed[workload] = results.proposed.get(workload, 0) + (
                            after[0] - before[0]
                        )
                        results.accepted[workload] = results.accepted.get(workload, 0) + (
                            after[1] - before[1]
                        )
            results.same.setdefault(workload, []).append(len(set(texts.values())) == 1)
            results.loads.setdefault(workload, []).append(os.getloadavg()[0])
        print(f"  round {r + 1} done (load {os.getloadavg()[0]:.1f})", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shape", default="smollm2", choices=["small", "qwen3-0.6b", "smollm2", CODER]
    )
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--spec",
        default="{method: prompt_lookup}",
        help="the `speculative` options of the server with speculation (YAML flow map)",
    )
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--budget", type=float, default=330.0, help="seconds of rounds at most")
    parser.add_argument(
        "--dtype",
        default="",
        help="the model's options.dtype for both servers ('' = auto; float32: SmolLM2's"
        " weights dequantized, the float32 row of issue 21's table)",
    )
    parser.add_argument(
        "--source", default="", help="another model than --shape's (a model source)"
    )
    parser.add_argument("--sha256", default="", help="the --source file's sha256")
    parser.add_argument("--pipeline", default="auto", help="the --source model's pipeline")
    parser.add_argument("--blas-threads", default="", help="OPENBLAS_NUM_THREADS ('' = default)")
    parser.add_argument(
        "--no-pause",
        action="store_true",
        help="leave the idle server running instead of SIGSTOPping it (an idle engine sleeps)",
    )
    args = parser.parse_args()
    # Killed (a timeout, Ctrl-C from a wrapper): stop the servers on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    home = pipeserve_home()
    if args.source:
        from pipeserve.engine.weights.loader import resolve_source

        model_dir, pipeline = resolve_source(args.source, args.sha256 or None), args.pipeline
    else:
        model_dir, pipeline = bench_model(args.shape, home)
    work = Path(tempfile.mkdtemp(prefix="pipeserve-spec-bench-"))
    env = bench_environment(home, args.blas_threads)
    base: dict[str, Any] = {"max_batch": 8, "queue_size": 64}
    if args.dtype:
        base["dtype"] = args.dtype
    servers = [
        start_pipeserve(model_dir, work, env, base, pipeline, name="without"),
        start_pipeserve(
            model_dir, work, env, {**base, "speculative": args.spec}, pipeline, name="with"
        ),  # fmt: skip
    ]
    print(
        f"model {model_dir.name} (dtype {args.dtype or 'auto'}); speculative {args.spec};"
        f" {args.tokens} tokens per stream;"
        f" {args.rounds} alternating rounds; load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    results, code = Results(), 0
    try:
        for server in servers:
            stream_once(server.base, CHAT, 8)  # warm-up
            if args.no_pause:
                server.pause = server.resume  # type: ignore[method-assign]
            server.pause()
        run_rounds(servers, args, results)
    except Hung as exc:
        code = 1
        print(f"\nHUNG: {exc}", flush=True)
        for server in servers:
            log = work / f"{server.name}.log"
            print(f"--- {server.name} log tail ---\n{log.read_text()[-2000:]}", flush=True)
    finally:
        for server in servers:
            server.stop()
    print(f"\n{results.table()}")
    print("decode tok/s (edit x8: aggregate); ratio = with / without, median of the rounds;")
    print("same = rounds in which both servers' answers were identical;")
    print(
        f"accepted = accepted / proposed tokens; load = 1-min load average ({os.cpu_count()} CPUs)"
    )
    return code


if __name__ == "__main__":
    raise SystemExit(main())
