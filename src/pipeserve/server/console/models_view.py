"""What the console's Models view shows of each served model: state and memory, where
it runs, its sampling defaults, its pipeline as the chain of stages with their params,
the routes that serve it and, for a sharded model, its ranks, hosts and layers."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from pipeserve.api.base import WireProtocol
from pipeserve.backend import installed_backends
from pipeserve.config.models import EMBEDDING_APIS, EndpointEntry, KvCacheOptions, ShardingOptions
from pipeserve.engine.weights.attention_shape import kv_elements_per_token
from pipeserve.server.registry import ServedModel


def describe_model(
    served: ServedModel,
    endpoints: Sequence[EndpointEntry],
    protocols: Mapping[str, WireProtocol],
    config_dir: Path,
) -> dict[str, Any]:
    entry, runtime = served.entry, served.runtime
    engine = runtime.engine
    residency = dict(engine.describe()) or {"state": "loaded", "load": "startup"}
    stats = engine.stats()
    return {
        "name": served.name,
        "aliases": list(entry.aliases),
        "family": served.family,
        "pipeline": entry.pipeline,
        "source": entry.source,
        "engine": entry.engine,
        "state": state_of(residency),
        "error": residency.get("load_error"),
        "loading_seconds": residency.get("loading_seconds"),
        "load": residency.get("load", entry.load),
        "keep_alive": entry.keep_alive if entry.load == "on_demand" else None,
        "memory_bytes": int(residency.get("memory_bytes", stats.get("memory_bytes", 0))),
        "device": device_of(entry.engine),
        "backend": ", ".join(installed_backends()) or "mlx",
        "context_length": runtime.context_length,
        "kv_bytes_per_token": kv_bytes_per_token(runtime.model_dir, entry.options.kv_cache),
        "default_max_tokens": runtime.default_max_tokens,
        "sampling": dict(runtime.sampling_defaults),
        "capabilities": sorted(served.chain.capabilities()),
        "stages": [
            {"kind": d.kind, "role": d.role, "params": d.params.model_dump(mode="json")}
            for d in served.stages
        ],
        "routes": routes_of(served.name, endpoints, protocols, entry.kind),
        "kind": entry.kind,
        "embedding": runtime.embedding.describe() if runtime.embedding is not None else None,
        "in_flight": int(stats.get("in_flight", stats.get("active_sequences", 0))),
        "queue": int(stats.get("queue_depth", 0)),
        "healthy": engine.healthy,
        "health_reason": engine.health_reason,
        "sharding": sharding_of(served, config_dir),
        "adapters": adapters_of(served, residency),
    }


def adapters_of(served: ServedModel, residency: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The model's LoRA adapters: the names requests use, the folder, and why the load
    refused one (docs/adapters.md)."""
    errors = residency.get("adapter_errors") or {}
    return [
        {
            "name": a.name,
            "request_name": f"{served.name}:{a.name}",
            "path": a.path,
            "error": errors.get(a.name),
        }
        for a in served.entry.adapters
    ]


def kv_bytes_per_token(model_dir: Path, quantized: KvCacheOptions | None) -> int | None:
    """Keys and values of one token over every layer as the engine caches them: float32
    (4 bytes an element of engine/weights/attention_shape.py's count, from the model's
    config.json), or that quantized per `options.kv_cache`; None without a config.json
    (e.g. a replay engine's folder) or without those fields."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    elements = kv_elements_per_token(config) if isinstance(config, dict) else None
    if elements is None:
        return None
    return elements * 4 if quantized is None else quantized.bytes_per_token(elements * 4)


def state_of(residency: Mapping[str, Any]) -> str:
    """loaded, loading, on demand (not resident, loads on the next request) or failed."""
    if residency.get("load_error") and residency.get("state") != "loaded":
        return "failed"
    return {"not-loaded": "on demand"}.get(str(residency.get("state")), str(residency["state"]))


@cache
def device_of(engine: str) -> str:
    """From the installed MLX backend, without importing MLX here (a worker whose models
    run in the engine host must not open a GPU context of its own)."""
    if engine == "replay":
        return "none (replay: scripted output, no weights)"
    kinds = set(installed_backends().values())
    if "cuda" in kinds:
        return "gpu (CUDA)"
    if "metal" in kinds or sys.platform == "darwin":
        return "gpu (Metal)"
    return "cpu"


_EMBEDDING_PATHS: dict[tuple[str, str], tuple[str, ...]] = {
    ("embedding", "openai-embeddings"): ("",),
    ("embedding", "ollama"): ("/embed", "/embeddings"),
    ("rerank", "rerank"): ("",),
}


def routes_of(
    name: str,
    endpoints: Sequence[EndpointEntry],
    protocols: Mapping[str, WireProtocol],
    kind: str = "generation",
) -> list[dict[str, Any]]:
    """Each route that serves the model, with its protocol and its paths (generation
    paths for a generation model, the embedding or rerank paths for the others)."""
    out = []
    for endpoint in endpoints:
        if endpoint.models is not None and name not in endpoint.models:
            continue
        protocol = protocols.get(endpoint.route)
        if kind == "generation":
            if endpoint.api in EMBEDDING_APIS:
                continue
            paths = protocol.generation_paths if protocol is not None else ("",)
        elif (kind, endpoint.api) in _EMBEDDING_PATHS:
            paths = _EMBEDDING_PATHS[(kind, endpoint.api)]
        else:
            continue
        base = endpoint.route.rstrip("/")
        out.append({"route": endpoint.route, "api": endpoint.api,
                    "paths": [(base + p) or "/" for p in paths]})  # fmt: skip
    return out


def sharding_of(served: ServedModel, config_dir: Path) -> dict[str, Any] | None:
    """The plan of a sharded model: each rank's host and layers, and the group's health."""
    sharding = served.entry.options.sharding
    if sharding is None:
        return None
    hosts = _hosts(sharding, config_dir)
    size = len(hosts) if hosts else sharding.size
    layers = _layer_ranges(served.runtime.model_dir, sharding, size)
    ranks = [
        {
            "rank": rank,
            "host": hosts[rank] if hosts else "this machine",
            "layers": layers[rank] if layers else "a slice of every layer",
        }
        for rank in range(size)
    ]
    engine = served.runtime.engine
    return {
        "strategy": sharding.strategy,
        "backend": sharding.backend,
        "ranks": ranks,
        "healthy": engine.healthy,
        "reason": engine.health_reason,
    }


def _hosts(sharding: ShardingOptions, config_dir: Path) -> list[str]:
    if sharding.hostfile is None:
        return []
    from pipeserve.engine.sharding.hostfile import read_hostfile

    hosts, _ = read_hostfile(config_dir / sharding.hostfile)
    return [str(h.get("ssh")) for h in hosts]


def _layer_ranges(model_dir: Path, sharding: ShardingOptions, size: int) -> list[str]:
    """`[start, end)` per rank for the pipeline strategy (rank 0 holds the last layers)."""
    if sharding.strategy != "pipeline":
        return []
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        count = int(config.get("num_hidden_layers") or config["text_config"]["num_hidden_layers"])
        from pipeserve.engine.sharding.pipeline import layer_ranges

        ranges = layer_ranges(count, size, sharding.split)
        return [f"layer {a}" if b - a == 1 else f"layers {a}-{b - 1}" for a, b in ranges]
    except (OSError, ValueError, KeyError, TypeError):
        return []
