"""Prometheus view of the fleet: which models are resident, their memory, loads, unloads."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pipeserve.server.fleet import FleetView


class FleetCollector(Collector):
    """`view` is this worker's fleet, or the engine host's (server.workers > 1)."""

    def __init__(
        self, view: Callable[[], FleetView], reloads: Callable[[], dict[str, int]]
    ) -> None:
        self.view = view
        self.reloads = reloads

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        fleet = self.view()
        resident = GaugeMetricFamily(
            "pipeserve_model_resident", "1 while the model's weights are loaded", labels=["model"]
        )
        memory = GaugeMetricFamily(
            "pipeserve_model_memory_bytes",
            "Resident model memory: weights as stored plus the prefix cache",
            labels=["model"],
        )
        for name, loaded, nbytes in fleet.models:
            resident.add_metric([name], float(loaded))
            memory.add_metric([name], float(nbytes))
        yield resident
        yield memory
        yield GaugeMetricFamily(
            "pipeserve_resident_models", "Models loaded or loading", value=fleet.resident
        )
        yield GaugeMetricFamily(
            "pipeserve_resident_models_peak",
            "Most models loaded or loading at once since the worker started",
            value=fleet.peak_resident,
        )
        yield GaugeMetricFamily(
            "pipeserve_resident_memory_bytes",
            "Memory of the loaded models (as counted against the budget)",
            value=fleet.resident_bytes,
        )
        if fleet.budget is not None:
            yield GaugeMetricFamily(
                "pipeserve_memory_budget_bytes", "This worker's memory budget", value=fleet.budget
            )
        loads = CounterMetricFamily("pipeserve_model_loads", "Model loads", labels=["model"])
        for name, count in sorted(fleet.loads.items()):
            loads.add_metric([name], count)
        yield loads
        unloads = CounterMetricFamily(
            "pipeserve_model_unloads", "Model unloads by reason", labels=["model", "reason"]
        )
        for (name, reason), count in sorted(fleet.unloads.items()):
            unloads.add_metric([name, reason], count)
        yield unloads
        reloads = CounterMetricFamily(
            "pipeserve_config_reloads", "Config reloads applied by this worker", labels=["outcome"]
        )
        for outcome, count in sorted(self.reloads().items()):
            reloads.add_metric([outcome], count)
        yield reloads
