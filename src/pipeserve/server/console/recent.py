"""The last minutes of traffic, per second, for the console's Live view.

Fed by the metrics tap (`Metrics.observe_stream`): a generation stream starting and
ending, each output event (a text, reasoning or tool-argument delta: about one token),
and each time to first output. Read as buckets of a few seconds with the requests in
flight, output per second and TTFT percentiles. Queue depth comes from the engines'
gauges, sampled whenever the Live endpoint is read. One worker's view: with
`server.workers > 1` each worker keeps its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

WINDOW_SECONDS = 300
BUCKET_SECONDS = 10
MAX_TTFT_SAMPLES = 1000  # per second: enough for percentiles, bounded under floods


@dataclass
class Second:
    """What happened during one wall-clock second."""

    at: int
    started: int = 0
    outputs: int = 0
    ttfts: list[float] = field(default_factory=list)
    in_flight_max: int = 0
    in_flight_end: int = 0
    queue_max: int | None = None


class RecentActivity:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.in_flight = 0
        self._seconds: dict[int, Second] = {}
        self._lock = threading.Lock()

    def _second(self) -> Second:
        now = int(self.clock())
        slot = self._seconds.get(now)
        if slot is None:
            slot = self._seconds[now] = Second(now, in_flight_end=self.in_flight)
            slot.in_flight_max = self.in_flight
            for old in [t for t in self._seconds if t <= now - WINDOW_SECONDS]:
                del self._seconds[old]
        return slot

    def begin(self) -> None:
        with self._lock:
            self.in_flight += 1
            slot = self._second()
            slot.started += 1
            self._level(slot)

    def end(self) -> None:
        with self._lock:
            self.in_flight -= 1
            self._level(self._second())

    def _level(self, slot: Second) -> None:
        slot.in_flight_end = self.in_flight
        slot.in_flight_max = max(slot.in_flight_max, self.in_flight)

    def output(self, ttft: float | None = None) -> None:
        with self._lock:
            slot = self._second()
            slot.outputs += 1
            if ttft is not None and len(slot.ttfts) < MAX_TTFT_SAMPLES:
                slot.ttfts.append(ttft)

    def note_queue(self, depth: int) -> None:
        with self._lock:
            slot = self._second()
            slot.queue_max = max(slot.queue_max or 0, depth)

    def series(self, bucket: int = BUCKET_SECONDS) -> list[dict[str, Any]]:
        """Buckets of `bucket` seconds over the window, oldest first; quiet seconds
        carry the in-flight level of the second before them."""
        with self._lock:
            now = int(self.clock())
            seconds = dict(self._seconds)
            level = self.in_flight
        start = now - WINDOW_SECONDS + 1
        start -= start % bucket
        carried = _level_before(seconds, start)
        out = []
        for first in range(start, now + 1, bucket):
            slots = [seconds.get(t) for t in range(first, min(first + bucket, now + 1))]
            row, carried = _bucket(first, slots, carried)
            out.append(row)
        if out:
            out[-1]["in_flight"] = max(out[-1]["in_flight"], level)
        return out


def _level_before(seconds: dict[int, Second], start: int) -> int:
    earlier = [t for t in seconds if t < start]
    return seconds[max(earlier)].in_flight_end if earlier else 0


def _bucket(first: int, slots: list[Second | None], carried: int) -> tuple[dict[str, Any], int]:
    in_flight = carried
    outputs = started = 0
    ttfts: list[float] = []
    queue: int | None = None
    for slot in slots:
        if slot is None:
            continue
        in_flight = max(in_flight, slot.in_flight_max)
        carried = slot.in_flight_end
        outputs += slot.outputs
        started += slot.started
        ttfts += slot.ttfts
        if slot.queue_max is not None:
            queue = max(queue or 0, slot.queue_max)
    span = max(1, len(slots))
    row = {
        "t": first,
        "requests": started,
        "tokens_per_s": round(outputs / span, 2),
        "in_flight": in_flight,
        "queue": queue,
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p90": percentile(ttfts, 90),
        "ttft_p99": percentile(ttfts, 99),
    }
    return row, carried


def percentile(values: list[float], pct: float) -> float | None:
    """Nearest-rank percentile in seconds (None without samples)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * pct // 100))
    return round(ordered[int(rank) - 1], 4)
