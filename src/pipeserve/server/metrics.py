"""Prometheus metrics (prometheus-client), one registry per app.

Counters and histograms are fed by `observe_stream`, a pass-through tap placed between
the stage chain and the encoder; engine gauges are read at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pipeserve.events import ContentDelta, Event, ReasoningDelta, ToolCallArgsDelta, Usage
from pipeserve.server.console.recent import RecentActivity

OUTPUT_EVENTS = (ContentDelta, ReasoningDelta, ToolCallArgsDelta)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class EngineCollector(Collector):
    """Reads each engine's live stats (queue depth, active sequences, cache hits)."""

    def __init__(self, stats_by_model: Callable[[], dict[str, dict[str, Any]]]) -> None:
        self._stats_by_model = stats_by_model

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = {
            "queue_depth": GaugeMetricFamily(
                "pipeserve_queue_depth", "Requests waiting for a batch slot", labels=["model"]
            ),
            "active_sequences": GaugeMetricFamily(
                "pipeserve_active_sequences", "Sequences being decoded", labels=["model"]
            ),
            "prefix_cache_hits": GaugeMetricFamily(
                "pipeserve_prefix_cache_hits",
                "Requests that reused a cached prompt prefix",
                labels=["model"],
            ),
            "prefix_cache_bytes": GaugeMetricFamily(
                "pipeserve_prefix_cache_bytes", "Bytes held by the prefix cache", labels=["model"]
            ),
            "prefill_tokens_total": GaugeMetricFamily(
                "pipeserve_prefill_tokens",
                "Prompt tokens the model computed (not from a cache or a shared prompt)",
                labels=["model"],
            ),
            "shared_prompt_rows_total": GaugeMetricFamily(
                "pipeserve_shared_prompt_rows",
                "Choices (n) that started from another choice's prompt KV instead of a prefill",
                labels=["model"],
            ),
            "yielded_batches_total": GaugeMetricFamily(
                "pipeserve_embedding_yielded_batches",
                "Embedding batches made small and paused because chat was decoding "
                "(embedding.chat_share)",
                labels=["model"],
            ),
        }
        for model, stats in self._stats_by_model().items():
            for key, family in families.items():
                if key in stats:
                    family.add_metric([model], float(stats[key]))
        yield from families.values()


class Metrics:
    def __init__(self, stats_by_model: Callable[[], dict[str, dict[str, Any]]]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pipeserve_requests",
            "HTTP requests by route, model and status",
            ["route", "model", "status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "pipeserve_prompt_tokens", "Prompt tokens", ["model"], registry=self.registry
        )
        self.cached_tokens = Counter(
            "pipeserve_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache",
            ["model"],
            registry=self.registry,
        )
        self.completion_tokens = Counter(
            "pipeserve_completion_tokens", "Generated tokens", ["model"], registry=self.registry
        )
        self.proposed_tokens = Counter(
            "pipeserve_speculative_proposed_tokens",
            "Tokens proposed by speculative decoding (prompt lookup, predictions)",
            ["model"],
            registry=self.registry,
        )
        self.accepted_tokens = Counter(
            "pipeserve_speculative_accepted_tokens",
            "Proposed tokens the model accepted",
            ["model"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "pipeserve_time_to_first_token_seconds",
            "Request start to first output",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "pipeserve_inter_token_latency_seconds",
            "Time between consecutive outputs",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(EngineCollector(stats_by_model))
        self.recent = RecentActivity()  # the console's Live view

    def count_request(self, route: str, model: str, status: int) -> None:
        self.requests.labels(route=route, model=model, status=str(status)).inc()

    def observe_stream(
        self, events: Iterable[Event], model: str, started: float
    ) -> Iterator[Event]:
        """Pass every event through while recording latency and token counters."""
        last_output: float | None = None
        self.recent.begin()
        try:
            for event in events:
                if isinstance(event, OUTPUT_EVENTS):
                    now = time.monotonic()
                    if last_output is None:
                        self.ttft.labels(model).observe(now - started)
                        self.recent.output(now - started)
                    else:
                        self.itl.labels(model).observe(now - last_output)
                        self.recent.output()
                    last_output = now
                elif isinstance(event, Usage):
                    self.prompt_tokens.labels(model).inc(event.prompt_tokens)
                    self.cached_tokens.labels(model).inc(event.cached_tokens)
                    self.completion_tokens.labels(model).inc(event.completion_tokens)
                    self.proposed_tokens.labels(model).inc(event.proposed_tokens)
                    self.accepted_tokens.labels(model).inc(event.accepted_tokens)
                yield event
        finally:
            self.recent.end()

    def render(self) -> bytes:
        return generate_latest(self.registry)
