"""Reliability under mixed load: valid, invalid and disconnecting clients across three
models for a few minutes, with a config reload (SIGHUP) in the middle.

    python benchmarks/reliability_load.py [--duration 180] [--clients 6] [--out FILE]

A real `pipeserve serve` on 127.0.0.1 serves three demo models through MLX: one loaded at
start, two loaded on demand within a memory budget that holds only one of them beside the
first (so they swap under load). Client threads loop over scenarios: OpenAI Chat (plain and
streamed) and Anthropic Messages with the official SDKs; invalid requests (unknown model,
out-of-range parameter, malformed JSON, missing field); clients that leave mid-stream,
mid-body, or right after connecting. Halfway through, the config is rewritten (one model
changed, one given an alias) and the master gets SIGHUP. Reported: requests by scenario
and outcome, errors by class, 5xx count (target 0), unexpected outcomes, worker memory
(RSS) and the server's own resident-model metrics before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.server.serverproc import server_process

REPO = Path(__file__).resolve().parents[1]
BUDGET = 150_000_000  # qwen3 demo ~39 MB (startup) + kimi ~52 MB or glm ~78 MB, not both
MESSAGES = [{"role": "user", "content": "Say something about lighthouses."}]


def config_text(reloaded: bool) -> str:
    kimi_tokens = 12 if reloaded else 16  # changed by the reload: kimi is rebuilt
    alias = ', aliases: ["q-*"]' if reloaded else ""  # chain-only change for qwen
    return f"""
pipelines_dir: {REPO / "pipelines"}
server: {{memory_budget: {BUDGET}, request_timeout: 120, body_read_timeout: 5}}
models:
  - {{name: qwen, source: "demo:qwen3", pipeline: auto{alias}, options: {{default_max_tokens: 16}}}}
  - {{name: kimi, source: "demo:kimi", pipeline: auto, load: on_demand, keep_alive: 30,
     options: {{default_max_tokens: {kimi_tokens}}}}}
  - {{name: glm, source: "demo:glm", pipeline: auto, load: on_demand, keep_alive: 30,
     options: {{default_max_tokens: 16}}}}
endpoints:
  - {{route: /v1/chat/completions, api: openai-chat}}
  - {{route: /v1/messages, api: anthropic-messages}}
"""


MODELS = ("qwen", "kimi", "glm")


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.unexpected: Counter[tuple[str, str]] = Counter()
        self.samples: dict[tuple[str, str], str] = {}

    def add(
        self, scenario: str, outcome: str, expected: Callable[[str], bool], note: str = ""
    ) -> None:
        with self.lock:
            self.outcomes[(scenario, outcome)] += 1
            if not expected(outcome):
                self.unexpected[(scenario, outcome)] += 1
                self.samples.setdefault((scenario, outcome), note[:300])


def ok(outcome: str) -> bool:
    return outcome == "ok"


def client_4xx(outcome: str) -> bool:
    return outcome.startswith("4")


def left(outcome: str) -> bool:
    return outcome in ("left", "ok") or outcome.startswith("4")


# -- scenarios ------------------------------------------------------------------------------


def chat(base: str, tally: Tally, rng: random.Random) -> None:
    from openai import APIConnectionError, APIStatusError, OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0, timeout=180)
    model = rng.choice(MODELS)
    try:
        reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8)
        outcome = "ok" if reply.choices[0].finish_reason else "no-finish"
        tally.add("chat", outcome, ok)
    except APIStatusError as exc:
        tally.add("chat", str(exc.status_code), ok, str(exc.message))
    except APIConnectionError as exc:
        tally.add("chat", f"conn:{type(exc.__cause__).__name__}", ok, str(exc))


def chat_stream(base: str, tally: Tally, rng: random.Random) -> None:
    from openai import APIConnectionError, APIError, APIStatusError, OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0, timeout=180)
    model = rng.choice(MODELS)
    try:
        chunks = list(
            client.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=8, stream=True
            )
        )
        finished = any(c.choices and c.choices[0].finish_reason for c in chunks)
        tally.add("chat_stream", "ok" if finished else "no-finish", ok)
    except APIStatusError as exc:
        tally.add("chat_stream", str(exc.status_code), ok, str(exc.message))
    except APIConnectionError as exc:
        tally.add("chat_stream", f"conn:{type(exc.__cause__).__name__}", ok, str(exc))
    except APIError as exc:  # an in-stream error event
        tally.add("chat_stream", "stream-error", ok, str(exc))


def messages(base: str, tally: Tally, rng: random.Random) -> None:
    from anthropic import Anthropic, APIConnectionError, APIStatusError

    client = Anthropic(base_url=base, api_key="k", max_retries=0, timeout=180)
    model = rng.choice(MODELS)
    try:
        reply = client.messages.create(model=model, max_tokens=8, messages=MESSAGES)
        tally.add("messages", "ok" if reply.stop_reason else "no-stop", ok)
    except APIStatusError as exc:
        tally.add("messages", str(exc.status_code), ok, str(exc.message))
    except APIConnectionError as exc:
        tally.add("messages", f"conn:{type(exc.__cause__).__name__}", ok, str(exc))


INVALID_BODIES: list[tuple[str, bytes]] = [
    ("unknown_model", json.dumps({"model": "nope", "messages": MESSAGES}).encode()),
    (
        "bad_temperature",
        json.dumps({"model": "qwen", "messages": MESSAGES, "temperature": 9}).encode(),
    ),
    ("malformed_json", b'{"model": "qwen", "messages": ['),
    ("missing_messages", json.dumps({"model": "glm"}).encode()),
    (
        "bad_max_tokens",
        json.dumps({"model": "kimi", "messages": MESSAGES, "max_tokens": -3}).encode(),
    ),
]


def invalid(base: str, tally: Tally, rng: random.Random) -> None:
    name, body = rng.choice(INVALID_BODIES)
    try:
        resp = httpx.post(
            f"{base}/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        error = resp.json().get("error", {}) if resp.status_code >= 400 else {}
        shaped = "" if isinstance(error, dict) and error.get("message") else "-unshaped"
        tally.add(f"invalid:{name}", f"{resp.status_code}{shaped}", client_4xx, resp.text)
    except httpx.HTTPError as exc:
        tally.add(f"invalid:{name}", f"conn:{type(exc).__name__}", client_4xx, str(exc))


def leave_mid_stream(base: str, tally: Tally, rng: random.Random) -> None:
    body = {"model": rng.choice(MODELS), "messages": MESSAGES, "max_tokens": 64, "stream": True}
    try:
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=180) as resp:
            status = resp.status_code
            for _ in resp.iter_lines():
                break  # leave after the first line
        tally.add("leave_mid_stream", "left" if status == 200 else str(status), left)
    except httpx.HTTPError as exc:
        tally.add("leave_mid_stream", f"conn:{type(exc).__name__}", left, str(exc))


def leave_mid_body(base: str, tally: Tally, rng: random.Random) -> None:
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 400\r\n\r\n{"model": "qwen", "mess'
        )
    tally.add("leave_mid_body", "left", left)


def connect_and_close(base: str, tally: Tally, rng: random.Random) -> None:
    host, port = base.removeprefix("http://").split(":")
    socket.create_connection((host, int(port)), timeout=30).close()
    tally.add("connect_close", "left", left)


SCENARIOS: list[tuple[Callable[[str, Tally, random.Random], None], int]] = [
    (chat, 6),
    (chat_stream, 6),
    (messages, 4),
    (invalid, 5),
    (leave_mid_stream, 3),
    (leave_mid_body, 1),
    (connect_and_close, 1),
]


def client_loop(base: str, tally: Tally, seed: int, stop_at: float) -> None:
    rng = random.Random(seed)
    functions = [f for f, _ in SCENARIOS]
    weights = [w for _, w in SCENARIOS]
    while time.monotonic() < stop_at:
        scenario = rng.choices(functions, weights)[0]
        try:
            scenario(base, tally, rng)
        except Exception as exc:  # a scenario bug must not end the run silently
            tally.add(scenario.__name__, f"crash:{type(exc).__name__}", lambda _: False, repr(exc))


# -- measurements ---------------------------------------------------------------------------


def group_rss_bytes(pgid: int) -> dict[int, int]:
    """RSS of every process of the server's process group (master and workers)."""
    out: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:
                continue
            status = (stat.parent / "status").read_text()
        except (OSError, IndexError, ValueError):
            continue
        match = re.search(r"VmRSS:\s+(\d+) kB", status)
        if match:
            out[int(stat.parent.name)] = int(match.group(1)) * 1024
    return out


def server_metrics(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    wanted = (
        "pipeserve_resident_models",
        "pipeserve_resident_models_peak",
        "pipeserve_resident_memory_bytes",
        "pipeserve_model_loads_total",
        "pipeserve_model_unloads_total",
        "pipeserve_config_reloads_total",
    )
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(wanted):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def snapshot(base: str, pgid: int) -> dict[str, object]:
    rss = group_rss_bytes(pgid)
    return {"rss_bytes_by_pid": rss, "rss_bytes_total": sum(rss.values()), **server_metrics(base)}


def warm_up(base: str) -> None:
    for model in MODELS:
        body = {"model": model, "messages": MESSAGES, "max_tokens": 4}
        httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300).raise_for_status()


def run(duration: float, clients: int) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix="pipeserve-reliability-"))
    config = work / "reliability.yaml"
    config.write_text(config_text(reloaded=False))
    tally = Tally()
    with server_process(config, startup_timeout=600) as (base, proc):
        warm_up(base)
        before = snapshot(base, proc.pid)
        started = time.monotonic()
        stop_at = started + duration
        threads = [
            threading.Thread(target=client_loop, args=(base, tally, seed, stop_at), daemon=True)
            for seed in range(clients)
        ]
        for thread in threads:
            thread.start()
        time.sleep(duration / 2)
        config.write_text(config_text(reloaded=True))
        os.kill(proc.pid, signal.SIGHUP)
        reload_sent = time.monotonic() - started
        for thread in threads:
            thread.join(timeout=duration + 300)
        elapsed = time.monotonic() - started
        time.sleep(2)
        after = snapshot(base, proc.pid)
        alias_ok = httpx.post(
            f"{base}/v1/chat/completions",
            json={"model": "q-alias", "messages": MESSAGES, "max_tokens": 2},
            timeout=120,
        ).status_code
        alive = proc.poll() is None
    return report(tally, before, after, elapsed, reload_sent, alias_ok, alive, clients)


def report(
    tally: Tally,
    before: dict[str, object],
    after: dict[str, object],
    elapsed: float,
    reload_sent: float,
    alias_status: int,
    alive: bool,
    clients: int,
) -> dict[str, object]:
    by_class: Counter[str] = Counter()
    for (_, outcome), count in tally.outcomes.items():
        by_class[outcome_class(outcome)] += count
    total = sum(tally.outcomes.values())
    return {
        "duration_s": round(elapsed, 1),
        "clients": clients,
        "reload_sent_at_s": round(reload_sent, 1),
        "requests_total": total,
        "requests_per_s": round(total / elapsed, 2),
        "served_ok": by_class["ok"],
        "by_class": dict(by_class),
        "status_5xx": sum(c for (_, o), c in tally.outcomes.items() if o.startswith("5")),
        "unexpected": {f"{s} -> {o}": c for (s, o), c in tally.unexpected.items()},
        "unexpected_samples": {f"{s} -> {o}": n for (s, o), n in tally.samples.items()},
        "by_scenario": {f"{s} -> {o}": c for (s, o), c in sorted(tally.outcomes.items())},
        "alias_after_reload_status": alias_status,
        "server_alive_at_end": alive,
        "before": before,
        "after": after,
    }


def outcome_class(outcome: str) -> str:
    if outcome in ("ok", "left"):
        return outcome
    if outcome[:1] in "45" and outcome[:3].isdigit():
        return f"{outcome[0]}xx"
    return outcome.split(":")[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    parser.add_argument("--clients", type=int, default=6, help="concurrent client threads")
    parser.add_argument("--out", type=Path, help="also write the JSON report here")
    args = parser.parse_args()
    result = run(args.duration, args.clients)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0 if result["status_5xx"] == 0 and not result["unexpected"] else 1


if __name__ == "__main__":
    sys.exit(main())
