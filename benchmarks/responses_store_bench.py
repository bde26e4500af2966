"""What the response store costs a Responses request: store on vs off, side by side.

    python benchmarks/responses_store_bench.py [--requests 100] [--workers 2]

First times the store's own calls in process (save, get, the history of chains of 1..50
turns). Then starts two replay servers (one replay-qwen3 model each; one with a store in
a temporary folder, one with `responses_store: false`) and alternates, per round: one
single-turn request to each, then the next turn of one conversation resent in full to
the stateless server and continued by `previous_response_id` on the stored one (the same
prompt, so the difference is the store's). Prints median / p90 latency and the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.server.serverproc import running_server
from tests.server.store_servers import store_config

MOCK = {"mock_response": "<think>\nShort.\n</think>\n\nHello there!"}


def summary(samples: list[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[int(len(ordered) * 0.9)]
    return f"median {statistics.median(ordered):6.2f} ms  p90 {p90:6.2f} ms"


def in_process() -> None:
    from pipeserve.store import SqliteStore

    with tempfile.TemporaryDirectory() as tmp:
        store = SqliteStore(Path(tmp) / "r.sqlite3", 30, 1 << 30, 2.0)
        store.open_checked()
        text = [{"type": "output_text", "text": "x" * 500, "annotations": []}]
        times: dict[str, list[float]] = {"save": [], "get": [], "history": []}
        previous = None
        for i in range(50):
            item = {"type": "message", "role": "assistant", "content": text, "id": f"msg_{i}"}
            body = {"id": f"resp_{i}", "status": "completed", "output": [item]}
            calls: list[tuple[str, Any, tuple[Any, ...]]] = [
                ("save", store.save, (body, [{**item, "id": f"in_{i}"}], previous)),
                ("get", store.get, (body["id"],)),
                ("history", store.history, (body["id"],)),
            ]
            for name, call, args in calls:
                start = time.perf_counter()
                call(*args)
                times[name].append((time.perf_counter() - start) * 1000)
            previous = f"resp_{i}"
        for name, samples in times.items():
            print(f"{name:8s} {summary(samples)}")


def ask(client: httpx.Client, **fields: Any) -> tuple[dict[str, Any], float]:
    """Plain HTTP: the openai SDK's own request building grows with the input and would
    dominate the timing of long histories."""
    start = time.perf_counter()
    response = client.post("/v1/responses", json={"model": "replay-qwen3", **MOCK, **fields})
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body, (time.perf_counter() - start) * 1000


def over_http(requests: int, workers: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "off").mkdir()
        on_config = store_config(folder, workers)
        off_config = store_config(folder / "off", workers, store="false")
        with running_server(on_config) as on_base, running_server(off_config) as off_base:
            on = httpx.Client(base_url=on_base, timeout=60)
            off = httpx.Client(base_url=off_base, timeout=60)
            times: dict[str, list[float]] = {k: [] for k in ("off", "on", "resent", "chained")}
            history: list[dict[str, Any]] = []
            previous: str | None = None
            for i in range(requests):
                times["off"].append(ask(off, input=f"hi {i}")[1])
                times["on"].append(ask(on, input=f"hi {i}")[1])
                turn = {"role": "user", "content": f"turn {i}"}
                resent, took = ask(off, input=[*history, turn], store=False)
                times["resent"].append(took)
                chained, took = ask(on, input=[turn], previous_response_id=previous)
                times["chained"].append(took)
                previous = chained["id"]
                history += [turn, *resent["output"]]
            pairs = (("off", "off"), ("on", "off"), ("resent", "resent"), ("chained", "resent"))
            for name, against in pairs:
                ratio = statistics.median(times[name]) / statistics.median(times[against])
                print(f"{name:8s} {summary(times[name])}  x{ratio:.2f} of {against}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    in_process()
    over_http(args.requests, args.workers)


if __name__ == "__main__":
    main()
