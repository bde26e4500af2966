"""The models of one worker: which are resident, loading them on demand within a budget.

One load (or unload) at a time per worker; other models keep serving meanwhile (loads run
off the gevent hub). To make room for a model, idle models loaded on demand are unloaded,
least recently used first; a model busy with requests is never unloaded, so a load may
wait for one to go idle. `load: startup` models are loaded at boot and never unloaded
while configured. A reaper unloads on_demand models idle for their keep_alive, and the
models a reload removed or replaced once their last request ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pipeserve.config.models import ModelEntry
from pipeserve.engine.base import Engine
from pipeserve.errors import ApiError
from pipeserve.server.managed_engine import ManagedEngine, Ticket, draft_bytes, weights_bytes

log = logging.getLogger("pipeserve.fleet")
REAP_INTERVAL = 1.0
ROOM_WAIT_POLL = 1.0


@dataclass(frozen=True)
class FleetView:
    """What /metrics shows of a fleet (also sent from the engine host to the workers)."""

    models: list[tuple[str, bool, int]] = field(default_factory=list)  # name, loaded, bytes
    resident: int = 0
    peak_resident: int = 0
    resident_bytes: int = 0
    budget: int | None = None
    loads: dict[str, int] = field(default_factory=dict)
    unloads: dict[tuple[str, str], int] = field(default_factory=dict)


class Fleet:
    def __init__(self, budget: int | None = None, room_timeout: float = 600.0) -> None:
        self.budget = budget
        self.room_timeout = room_timeout
        self.current: dict[str, ManagedEngine] = {}
        self.retiring: list[ManagedEngine] = []
        self.loads: Counter[str] = Counter()
        self.unloads: Counter[tuple[str, str]] = Counter()
        self.peak_resident = 0
        self._lock = threading.Lock()  # one load or unload at a time
        self._released = threading.Event()
        self._tickets: dict[int, list[Ticket]] = {}
        self._reaper_started = False

    # -- building -----------------------------------------------------------------------

    def manager_for(
        self, entry: ModelEntry, draft: ModelEntry | None = None
    ) -> Callable[[Callable[[], Engine], Path], Engine]:
        """build_runtime's `manage`: wrap the engine's start in a ManagedEngine (not started).
        draft: the model its speculative method draft loads with it (counted in its size)."""

        def manage(start: Callable[[], Engine], model_dir: Path) -> Engine:
            return ManagedEngine(
                entry.name,
                start,
                self,
                pinned=entry.load == "startup",
                keep_alive=entry.keep_alive,
                size=weights_bytes(model_dir) + draft_bytes(draft) if entry.engine == "mlx" else 0,
                accepts_mock_response=entry.engine == "replay",
                max_tokens_limit=entry.options.max_tokens_limit,
                hosted=entry.engine == "mlx" and entry.options.sharding is None,
            )

        return manage

    def set_current(self, engines: Iterable[ManagedEngine], gone: Iterable[ManagedEngine]) -> None:
        """The engines of the config now served; `gone` ones unload once their requests end."""
        self.current = {e.name: e for e in engines}
        for engine in gone:  # unloaded by the reaper once idle; may still load for
            engine.retired = True  # requests routed to it before the reload
            self.retiring.append(engine)
        self._note_peak()
        self.notify()

    def _note_peak(self, loading: ManagedEngine | None = None) -> None:
        resident = self.resident()
        count = len(resident) + (loading is not None and loading not in resident)
        self.peak_resident = max(self.peak_resident, count)

    def load_now(self, engine: ManagedEngine) -> None:
        """Load a startup model (blocking its caller); over the budget it loads with a warning."""
        with self._lock:
            if engine.engine is not None:
                return
            try:
                self._make_room(engine, wait=False)
            except ApiError as error:
                log.warning("%s; loading it anyway (load: startup)", error.message)
            self._load(engine)

    # -- on demand ----------------------------------------------------------------------

    def request_load(self, engine: ManagedEngine) -> Ticket:
        ticket = Ticket()
        if engine.retired and engine not in self.retiring:
            self.retiring.append(engine)  # so that it is counted, and unloaded when idle
        waiting = self._tickets.setdefault(id(engine), [])
        waiting.append(ticket)
        if len(waiting) == 1:
            threading.Thread(target=self._load_for, args=(engine,), daemon=True).start()
        return ticket

    def _load_for(self, engine: ManagedEngine) -> None:
        result: bool | ApiError = True
        try:
            with self._lock:
                if engine.engine is None:
                    self._make_room(engine, wait=True)
                    self._load(engine)
        except ApiError as error:
            result = error
        except Exception as exc:  # never leave waiting clients hanging
            log.exception("loading model %s failed", engine.name)
            result = ApiError("unavailable", f"model {engine.name} failed to load: {exc}")
        for ticket in self._tickets.pop(id(engine), []):
            ticket.set(result)

    def _make_room(self, engine: ManagedEngine, wait: bool) -> None:
        deadline = time.monotonic() + self.room_timeout
        while self.budget is not None and self.resident_bytes() + engine.size > self.budget:
            pinned = sum(e.size for e in self.resident() if e.pinned and not e.retired)
            if engine.size + pinned > self.budget:  # would not fit even alone: evict nothing
                raise ApiError(
                    "unavailable",
                    f"model {engine.name} needs {engine.size} bytes; the memory budget of "
                    f"{self.budget} bytes has {self.budget - pinned} left beside startup models",
                )
            victim = self._least_recently_used_idle(exclude=engine)
            if victim is not None:
                self._unload(victim, "memory budget")
                continue
            if not wait:
                raise ApiError(
                    "unavailable",
                    f"model {engine.name} does not fit the memory budget beside busy models",
                )
            if time.monotonic() > deadline:
                raise ApiError(
                    "overloaded",
                    f"model {engine.name} waited {self.room_timeout:.0f} s for busy models "
                    "to leave room in the memory budget",
                    retry_after=5.0,
                )
            self._released.clear()
            self._released.wait(ROOM_WAIT_POLL)

    def _least_recently_used_idle(self, exclude: ManagedEngine) -> ManagedEngine | None:
        idle = [
            e
            for e in self.resident()
            if e is not exclude and e.in_flight == 0 and (not e.pinned or e.retired)
        ]
        return min(idle, key=lambda e: e.last_used, default=None)

    def _load(self, engine: ManagedEngine) -> None:
        engine.mark_loading()
        self._note_peak(engine)
        engine.load()
        self.loads[engine.name] += 1

    def _unload(self, engine: ManagedEngine, reason: str) -> None:
        engine.unload(reason)
        self.unloads[(engine.name, reason)] += 1
        if engine in self.retiring:
            self.retiring.remove(engine)

    def notify(self) -> None:
        """A request ended: a load waiting for room may find some now."""
        self._released.set()

    # -- state ----------------------------------------------------------------------------

    def all_engines(self) -> list[ManagedEngine]:
        return list(self.current.values()) + list(self.retiring)

    def resident(self) -> list[ManagedEngine]:
        return [e for e in self.all_engines() if e.state != "unloaded"]

    def resident_bytes(self) -> int:
        return sum(e.memory_bytes() for e in self.resident())

    def view(self) -> FleetView:
        return FleetView(
            models=[(e.name, e.state == "loaded", e.memory_bytes()) for e in self.current.values()],
            resident=len(self.resident()),
            peak_resident=self.peak_resident,
            resident_bytes=self.resident_bytes(),
            budget=self.budget,
            loads=dict(self.loads),
            unloads=dict(self.unloads),
        )

    # -- reaper ---------------------------------------------------------------------------

    def start_reaper(self) -> None:
        if not self._reaper_started:
            self._reaper_started = True
            threading.Thread(target=self._reap_forever, daemon=True).start()

    def _reap_forever(self) -> None:
        while True:
            time.sleep(REAP_INTERVAL)
            try:
                self.reap()
            except Exception:  # the reaper must outlive any one fault
                log.exception("unloading idle models failed")

    def reap(self) -> None:
        """Unload expired on_demand models and drained removed ones (skipped while loading)."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            now = time.monotonic()
            for engine in list(self.retiring):
                if engine.in_flight == 0 and engine.state == "unloaded":
                    self.retiring.remove(engine)
                elif engine.in_flight == 0:
                    self._unload(engine, "removed by reload")
            for engine in list(self.current.values()):
                if _expired(engine, now):
                    self._unload(engine, "keep_alive")
        finally:
            self._lock.release()

    def close(self) -> None:
        for engine in self.all_engines():
            engine.close()


def _expired(engine: ManagedEngine, now: float) -> bool:
    return (
        not engine.pinned
        and engine.state == "loaded"
        and engine.in_flight == 0
        and engine.keep_alive is not None
        and now - engine.last_used >= engine.keep_alive
    )
