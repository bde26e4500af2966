"""The fleet loads an on_demand model in the background: its waiting stream gets keep-alives
while other models keep serving, and is still served when a reload replaces the model
meanwhile; the load is held at a gate so nothing depends on timing."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeserve.config.models import ModelEntry
from pipeserve.engine.base import Engine, GenerationJob
from pipeserve.engine.runtime import build_runtime
from pipeserve.events import ErrorEvent, Finish, KeepAlive, PromptReady, TokenText, Usage
from pipeserve.request import SamplingParams
from pipeserve.server.fleet import Fleet


def replay_entry(name: str, load: str) -> ModelEntry:
    return ModelEntry.model_validate(
        {
            "name": name,
            "source": "demo:qwen3",
            "pipeline": "qwen3",
            "engine": "replay",
            "load": load,
            "replay": {"completion": f"{name} answers"},
        }
    )


def job(tokens: list[int]) -> GenerationJob:
    return GenerationJob("r", tokens, SamplingParams(), max_tokens=16, keepalive_interval=0.01)


def test_waiting_stream_pings_while_other_models_serve(
    demo_model_dir: Callable[[str], Path],
) -> None:
    demo_model_dir("qwen3")
    fleet = Fleet()
    gate = threading.Event()
    on_demand = replay_entry("later", "on_demand")
    manage = fleet.manager_for(on_demand)

    def gated(start: Callable[[], Engine], folder: Path) -> Engine:
        return manage(lambda: gate.wait(60) and start(), folder)  # type: ignore[return-value]

    tokenizers: dict[Path, object] = {}
    later = build_runtime(on_demand, manage=gated, tokenizers=tokenizers)  # type: ignore[arg-type]
    resident_entry = replay_entry("now", "startup")
    resident = build_runtime(resident_entry, fleet.manager_for(resident_entry), tokenizers)  # type: ignore[arg-type]
    fleet.set_current([later.engine, resident.engine], [])  # type: ignore[list-item]
    fleet.load_now(resident.engine)  # type: ignore[arg-type]
    prompt = later.tokenizer.encode("hi")

    waiting = iter(later.engine.submit(job(prompt)))
    assert isinstance(next(waiting), KeepAlive)  # the load is held: the client gets pings
    # The fleet's loader thread marks the model loading; on a busy machine the first ping
    # (10 ms) can come before that thread has run, so wait for it while pinging.
    deadline = time.monotonic() + 30
    while later.engine.describe()["state"] != "loading" and time.monotonic() < deadline:  # type: ignore[attr-defined]
        assert isinstance(next(waiting), KeepAlive)
    assert later.engine.describe()["state"] == "loading"  # type: ignore[attr-defined]
    served = list(resident.engine.submit(job(prompt)))  # another model serves meanwhile
    assert isinstance(served[0], PromptReady) and isinstance(served[-1], Usage)
    assert isinstance(next(waiting), KeepAlive)

    # A reload replaces the model while its client waits: the client is still served by
    # the model its request was routed to (its prompt came from that model's tokenizer).
    successor = build_runtime(on_demand, fleet.manager_for(on_demand), tokenizers)  # type: ignore[arg-type]
    fleet.set_current([successor.engine, resident.engine], [later.engine])  # type: ignore[list-item]
    gate.set()
    rest = [e for e in waiting if not isinstance(e, KeepAlive)]
    assert isinstance(rest[0], PromptReady)
    text = "".join(e.text for e in rest if isinstance(e, TokenText))
    assert text == "later answers"
    assert isinstance(rest[-2], Finish) and isinstance(rest[-1], Usage)
    assert later.engine.in_flight == 0  # type: ignore[attr-defined]
    fleet.reap()  # the replaced model, idle now, is unloaded
    assert later.engine.describe()["state"] == "not-loaded"  # type: ignore[attr-defined]
    assert fleet.unloads[("later", "removed by reload")] == 1
    fleet.close()


def test_least_recently_used_idle_model_makes_room(demo_tokenizer: Callable[[str], Any]) -> None:
    from pipeserve.engine.replay import ReplayEngine
    from pipeserve.server.managed_engine import ManagedEngine

    tokenizer = demo_tokenizer("qwen3")
    fleet = Fleet(budget=100)

    def model(name: str, size: int = 40) -> ManagedEngine:
        def start() -> ReplayEngine:
            return ReplayEngine(name, tokenizer, frozenset(), f"{name} here")

        return ManagedEngine(
            name, start, fleet, pinned=False, keep_alive=None, size=size,
            accepts_mock_response=True, max_tokens_limit=None,
        )  # fmt: skip

    a, b, c = model("a"), model("b"), model("c")
    fleet.set_current([a, b, c], [])
    prompt = tokenizer.encode("hi")
    for engine in (a, b, a):  # b is now the least recently used
        assert isinstance(list(engine.submit(job(prompt)))[-1], Usage)
    held = iter(a.submit(job(prompt)))  # a is busy: in flight until this stream ends
    next(held)
    assert isinstance(list(c.submit(job(prompt)))[-1], Usage)
    assert [e.name for e in fleet.resident()] == ["a", "c"]
    assert fleet.unloads == {("b", "memory budget"): 1}
    list(held)
    d = model("d", size=200)  # larger than the whole budget: refused, nothing unloaded
    fleet.set_current([a, b, c, d], [])
    events = list(d.submit(job(prompt)))
    assert any(isinstance(e, ErrorEvent) and "memory budget" in e.message for e in events)
    assert [e.name for e in fleet.resident()] == ["a", "c"]
    fleet.close()


def os_threads() -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))


def test_reloading_a_model_reuses_its_engine_thread(demo_model_dir: Callable[[str], Path]) -> None:
    """An engine thread never exits (MLX's thread-exit destructor): an on_demand model runs
    every load on one host thread, so load/unload cycles do not pile threads up."""
    demo_model_dir("qwen3")
    fleet = Fleet()
    entry = ModelEntry(name="m", source="demo:qwen3", pipeline="qwen3", load="on_demand")
    runtime = build_runtime(entry, manage=fleet.manager_for(entry))
    engine = runtime.engine
    fleet.set_current([engine], [])  # type: ignore[list-item]
    prompt = runtime.tokenizer.encode("hi")
    counts = []
    for _ in range(3):
        fleet.load_now(engine)  # type: ignore[arg-type]
        assert isinstance(list(engine.submit(job(prompt)))[-1], Usage)
        fleet._unload(engine, "test")  # type: ignore[arg-type]
        counts.append(os_threads())
    assert counts[0] == counts[1] == counts[2], counts
    assert fleet.loads["m"] == 3
    fleet.close()
