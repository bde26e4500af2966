"""Speculative decoding served: the same model with and without `options.speculative`.

Two pipeserve servers on one model (OpenBLAS preloaded for both), one measured at a
time while the other is paused, alternating in rounds (the order flips each round):

- edit: a ~300-token source file in the prompt, asked back with one name changed;
  single-stream decode tok/s (after the first token);
- edit+prediction: the same with Chat's `prediction` set to the original file (sent to
  the server with speculation; the other gets the plain request);
- chat: an open question (nothing to look up): decode tok/s;
- edit x8: eight editing streams at once, aggregate tok/s.

Greedy decoding, so both servers produce the same text; the table gives the medians and
the median of the per-round ratios (with / without), and the acceptance seen.

    python benchmarks/spec_bench.py --shape smollm2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serve_bench import bench_model
from benchmarks.servers import BenchServer, bench_environment, start_pipeserve
from pipeserve.engine.demo import pipeserve_home

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
WORKLOADS = ("edit", "edit+prediction", "chat", "edit x8")
_tags = iter(range(1, 1 << 30))


def stream_once(
    base: str, prompt: str, max_tokens: int, prediction: str | None = None
) -> dict[str, float]:
    body: dict[str, Any] = {
        "model": "bench",
        # A new tag at the end: the file's prefix is cached (as an agent's resent
        # context is), each answer decoded afresh.
        "messages": [{"role": "user", "content": f"{prompt} [{next(_tags)}]"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if prediction is not None:
        body["prediction"] = {"type": "content", "content": prediction}
    first = last = None
    usage: dict[str, Any] = {}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=900) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            usage = data.get("usage") or usage
            if (data.get("choices") or [{}])[0].get("delta", {}).get("content"):
                last = time.perf_counter()
                first = first or last
    tokens = usage.get("completion_tokens", 0)
    details = usage.get("completion_tokens_details") or {}
    span = (last or 0) - (first or 0)
    return {
        "decode": (tokens - 1) / span if tokens > 1 and span > 0 else 0.0,
        "tokens": tokens,
        "accepted_prediction": details.get("accepted_prediction_tokens", 0),
    }


def concurrent(base: str, streams: int, max_tokens: int) -> float:
    results: list[dict[str, float]] = []
    threads = [
        threading.Thread(target=lambda: results.append(stream_once(base, EDIT, max_tokens)))
        for _ in range(streams)
    ]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(r["tokens"] for r in results) / (time.perf_counter() - started)


def measure(server: BenchServer, workload: str, tokens: int) -> float:
    if workload == "edit x8":
        return concurrent(server.base, 8, tokens)
    prompt = CHAT if workload == "chat" else EDIT
    # The server without `speculative` would still propose from a prediction: its
    # baseline is the same request without one.
    prediction = SOURCE if workload == "edit+prediction" and server.name == "with" else None
    return stream_once(server.base, prompt, tokens, prediction)["decode"]


def metric(server: BenchServer, name: str) -> float:
    text = httpx.get(f"{server.base}/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "_total{")
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="smollm2", choices=["small", "qwen3-0.6b", "smollm2"])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lookup-tokens", type=int, default=3)
    parser.add_argument("--blas-threads", default="", help="OPENBLAS_NUM_THREADS ('' = default)")
    parser.add_argument(
        "--no-pause",
        action="store_true",
        help="leave the idle server running instead of SIGSTOPping it (an idle engine sleeps)",
    )
    args = parser.parse_args()
    home = pipeserve_home()
    model_dir, pipeline = bench_model(args.shape, home)
    work = Path(tempfile.mkdtemp(prefix="pipeserve-spec-bench-"))
    env = bench_environment(home, args.blas_threads)
    base = {"max_batch": 8, "queue_size": 64}
    spec = {
        **base,
        "speculative": f"{{method: prompt_lookup, tokens: {args.lookup_tokens}, max_batch: 8}}",
    }
    servers = [
        start_pipeserve(model_dir, work, env, base, pipeline, name="without"),
        start_pipeserve(model_dir, work, env, spec, pipeline, name="with"),
    ]
    print(
        f"model {model_dir.name}; {args.tokens} tokens per stream; {args.rounds} alternating"
        f" rounds; load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    rounds: dict[str, dict[str, list[float]]] = {
        s.name: {w: [] for w in WORKLOADS} for s in servers
    }
    try:
        for server in servers:
            stream_once(server.base, CHAT, 8)
            if args.no_pause:
                server.pause = server.resume  # type: ignore[method-assign]
            server.pause()
        for r in range(args.rounds):
            for workload in WORKLOADS:
                for server in servers if r % 2 == 0 else servers[::-1]:
                    with server.active():
                        rounds[server.name][workload].append(measure(server, workload, args.tokens))
            print(f"  round {r + 1} done (load {os.getloadavg()[0]:.1f})", flush=True)
        with servers[1].active():
            proposed = metric(servers[1], "pipeserve_speculative_proposed_tokens")
            accepted = metric(servers[1], "pipeserve_speculative_accepted_tokens")
    finally:
        for server in servers:
            server.stop()
    print(f"\n{'workload':<18}{'without':>10}{'with':>10}{'ratio':>8}{'rounds':>14}")
    for workload in WORKLOADS:
        off, on = rounds["without"][workload], rounds["with"][workload]
        ratios = [b / a for a, b in zip(off, on) if a]
        print(
            f"{workload:<18}{statistics.median(off):>10.1f}{statistics.median(on):>10.1f}"
            f"{statistics.median(ratios):>8.2f}{min(ratios):>7.2f}-{max(ratios):.2f}"
        )
    print(f"tok/s; 'with' accepted {accepted:.0f} of {proposed:.0f} proposed tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
