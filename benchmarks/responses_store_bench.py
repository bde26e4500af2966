"""What the response store costs a Responses request: store on vs off, side by side.

    python benchmarks/responses_store_bench.py [--requests 100] [--workers 2]
    python benchmarks/responses_store_bench.py --postgres [--requests 100] [--workers 2]

First times the store's own calls in process (save, get, the history of chains of 1..50
turns). Then starts two replay servers (one replay-qwen3 model each; one with a store in
a temporary folder, one with `responses_store: false`) and alternates, per round: one
single-turn request to each, then the next turn of one conversation resent in full to
the stateless server and continued by `previous_response_id` on the stored one (the same
prompt, so the difference is the store's). Prints median / p90 latency and the ratios.

--postgres compares the two backends instead, on a throwaway PostgreSQL cluster (the
tests' tests/postgres_cluster.py; the system's postgresql package): the store calls in
process, SQLite and PostgreSQL alternating per call, then two replay servers (one per
backend) alternating per request: single turns and a conversation by
previous_response_id. Ratios are PostgreSQL over SQLite.
"""

from __future__ import annotations

import argparse
import os
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


def store_calls(store: Any, i: int, previous: str | None) -> list[tuple[str, Any, tuple[Any, ...]]]:
    text = [{"type": "output_text", "text": "x" * 500, "annotations": []}]
    item = {"type": "message", "role": "assistant", "content": text, "id": f"msg_{i}"}
    body = {"id": f"resp_{i}", "status": "completed", "output": [item]}
    return [
        ("save", store.save, (body, [{**item, "id": f"in_{i}"}], previous)),
        ("get", store.get, (body["id"],)),
        ("history", store.history, (body["id"],)),
    ]


def backends_in_process(stores: dict[str, Any], rounds: int = 50) -> None:
    """The same calls on each store in turn (chains of 1..rounds turns)."""
    times = {(b, c): [] for b in stores for c in ("save", "get", "history")}
    previous: str | None = None
    for i in range(rounds):
        for backend, store in stores.items():
            for name, call, args in store_calls(store, i, previous):
                start = time.perf_counter()
                call(*args)
                times[backend, name].append((time.perf_counter() - start) * 1000)
        previous = f"resp_{i}"
    first = next(iter(stores))
    for (backend, name), samples in times.items():
        ratio = statistics.median(samples) / statistics.median(times[first, name])
        print(f"{backend:9s} {name:8s} {summary(samples)}  x{ratio:.2f} of {first}")


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


def backends_over_http(requests: int, workers: int, folder: Path, urls: dict[str, str]) -> None:
    """One replay server per store, alternating per request: a single turn, then the next
    turn of one conversation (by previous_response_id) on each."""
    configs = {}
    for backend, store in urls.items():
        (folder / backend).mkdir()
        configs[backend] = store_config(folder / backend, workers, store=store)
    with running_server(configs["sqlite"]) as sqlite_base, running_server(configs["postgres"]) as pg_base:  # fmt: skip
        clients = {
            "sqlite": httpx.Client(base_url=sqlite_base, timeout=60),
            "postgres": httpx.Client(base_url=pg_base, timeout=60),
        }
        times = {(b, k): [] for b in clients for k in ("single", "chained")}
        previous: dict[str, str | None] = dict.fromkeys(clients)
        for i in range(requests):
            for backend, client in clients.items():
                times[backend, "single"].append(ask(client, input=f"hi {i}")[1])
                turn = [{"role": "user", "content": f"turn {i}"}]
                chained, took = ask(client, input=turn, previous_response_id=previous[backend])
                times[backend, "chained"].append(took)
                previous[backend] = chained["id"]
        for (backend, kind), samples in times.items():
            ratio = statistics.median(samples) / statistics.median(times["sqlite", kind])
            print(f"{backend:9s} {kind:8s} {summary(samples)}  x{ratio:.2f} of sqlite")


def compare_backends(requests: int, workers: int) -> None:
    from pipeserve.store import SqliteStore
    from pipeserve.store.postgres_store import PostgresStore
    from tests.postgres_cluster import PASSWORD, start_cluster

    with tempfile.TemporaryDirectory() as tmp, start_cluster() as cluster:
        os.environ["PGPASSWORD"] = PASSWORD  # the servers' password, as libpq reads it
        sqlite = SqliteStore(Path(tmp) / "r.sqlite3", 30, 1 << 30, 2.0)
        postgres = PostgresStore(cluster.url, 30, 1 << 30, 2.0)
        for store in (sqlite, postgres):
            store.open_checked()
        backends_in_process({"sqlite": sqlite, "postgres": postgres})
        postgres.close()
        cluster.wipe()
        urls = {"sqlite": "{path: responses.sqlite3}", "postgres": f"{{url: '{cluster.url}'}}"}
        backends_over_http(requests, workers, Path(tmp), urls)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--postgres", action="store_true", help="SQLite vs PostgreSQL")
    args = parser.parse_args()
    if args.postgres:
        compare_backends(args.requests, args.workers)
        return
    in_process()
    over_http(args.requests, args.workers)


if __name__ == "__main__":
    main()
