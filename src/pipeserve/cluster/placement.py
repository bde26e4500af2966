"""Where each rank of a sharded model runs and what it holds, from each machine's memory.

Pipeline: every machine gets a contiguous range of layers in proportion to its usable
memory (largest remainder, at least one layer each; rank 0, the serving machine, holds
the LAST layers as in mlx-lm). Tensor: every machine holds 1/N of every layer, so the
machines must be alike (same MLX device and backend) and the shapes divide by N. Either
way embeddings, the final norm and the head are on every machine, and each machine's
share must fit its usable memory. Pure functions of the inputs: validation, the server
and the tests all call them.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeserve.engine.sharding.pipeline import layer_ranges
from pipeserve.engine.sharding.support import sharding_problems
from pipeserve.errors import PlacementError

LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class Machine:
    address: str  # "this machine" for rank 0, else the node's host:port
    usable: int  # bytes this machine offers the model
    device: str  # MLX's default device: "cpu" or "gpu"
    backend: str  # the MLX backend installed: "cpu", "metal", "cuda"
    mlx: str  # MLX version


@dataclass(frozen=True)
class ModelSizes:
    layers: tuple[int, ...]  # bytes of each transformer layer
    other: int  # everything else (embeddings, final norm, head): on every rank

    @property
    def total(self) -> int:
        return self.other + sum(self.layers)


@dataclass(frozen=True)
class Share:
    rank: int
    machine: Machine
    layers: tuple[int, int] | None  # pipeline: [start, end); tensor: None (a slice of all)
    bytes: int  # the weights this rank holds

    def what(self, size: int) -> str:
        if self.layers is None:
            return f"1/{size} of every layer"
        return f"layers [{self.layers[0]}, {self.layers[1]})"


@dataclass(frozen=True)
class Plan:
    strategy: str
    shares: tuple[Share, ...]

    @property
    def split(self) -> list[int]:
        """Layers per rank, rank 0 first (ShardingOptions.split)."""
        return [s.layers[1] - s.layers[0] for s in self.shares if s.layers is not None]

    def describe(self) -> list[str]:
        size = len(self.shares)
        return [
            f"rank {s.rank} on {s.machine.address}: {s.what(size)}, {_mib(s.bytes)} of"
            f" {_mib(s.machine.usable)} usable"
            for s in self.shares
        ]

    def as_dict(self) -> dict[str, Any]:
        size = len(self.shares)
        return {
            "strategy": self.strategy,
            "ranks": [
                {**asdict(s), "holds": s.what(size), "layers": list(s.layers) if s.layers else None}
                for s in self.shares
            ],
        }


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def proportional_layers(layers: int, weights: list[int]) -> list[int]:
    """Layer counts in proportion to `weights`, summing to `layers`, each at least one."""
    count = len(weights)
    if layers < count:
        raise PlacementError(f"{layers} layers cannot be split over {count} machines")
    total = sum(weights)
    if total <= 0 or min(weights) < 0:
        raise PlacementError("every machine must offer some memory")
    quotas = [layers * w / total for w in weights]
    counts = [max(1, int(q)) for q in quotas]
    while sum(counts) > layers:  # the minimum of one pushed us over: take from the richest
        over = max((c - q, i) for i, (c, q) in enumerate(zip(counts, quotas)) if counts[i] > 1)
        counts[over[1]] -= 1
    while sum(counts) < layers:  # largest remainder first (ties: the earlier rank)
        under = max((q - c, -i) for i, (c, q) in enumerate(zip(counts, quotas)))
        counts[-under[1]] += 1
    return counts


def place(
    strategy: str, machines: list[Machine], sizes: ModelSizes, config: dict[str, Any]
) -> Plan:
    """The plan for `machines` (rank 0 first); PlacementError when it cannot be done."""
    size = len(machines)
    if size < 2:
        raise PlacementError("no other machine to shard over (found no usable node)")
    if strategy == "tensor":
        shares = _tensor_shares(machines, sizes, config)
    else:
        shares = _pipeline_shares(machines, sizes, config)
    short = [s for s in shares if s.bytes > s.machine.usable]
    if short:
        raise PlacementError(
            "; ".join(
                f"{s.machine.address} needs {_mib(s.bytes)} for {s.what(size)} but offers"
                f" {_mib(s.machine.usable)}"
                for s in short
            )
        )
    return Plan(strategy, tuple(shares))


def _pipeline_shares(
    machines: list[Machine], sizes: ModelSizes, config: dict[str, Any]
) -> list[Share]:
    # What is left for layers once the replicated weights are in: the basis of the split.
    room = [max(1, m.usable - sizes.other) for m in machines]
    split = proportional_layers(len(sizes.layers), room)
    problems = sharding_problems(config, "pipeline", len(machines), split)
    if problems:
        raise PlacementError("; ".join(problems))
    ranges = layer_ranges(len(sizes.layers), len(machines), split)
    return [
        Share(rank, machine, (start, end), sizes.other + sum(sizes.layers[start:end]))
        for rank, (machine, (start, end)) in enumerate(zip(machines, ranges))
    ]


def _tensor_shares(
    machines: list[Machine], sizes: ModelSizes, config: dict[str, Any]
) -> list[Share]:
    kinds = {(m.device, m.backend) for m in machines}
    if len(kinds) > 1:
        found = ", ".join(f"{m.address}: {m.backend} {m.device}" for m in machines)
        raise PlacementError(
            f"tensor sharding needs alike machines (same MLX backend and device); found {found};"
            " use strategy: pipeline"
        )
    problems = sharding_problems(config, "tensor", len(machines), None)
    if problems:
        raise PlacementError("; ".join(problems))
    each = sizes.other + -(-sum(sizes.layers) // len(machines))
    return [Share(rank, machine, None, each) for rank, machine in enumerate(machines)]


def model_sizes(model_dir: Path) -> ModelSizes:
    """Bytes per layer and of the rest, from the safetensors headers (no weights read)."""
    layers: dict[int, int] = {}
    other = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, nbytes in tensor_sizes(path).items():
            match = LAYER_NAME.search(name)
            if match:
                layers[int(match.group(1))] = layers.get(int(match.group(1)), 0) + nbytes
            else:
                other += nbytes
    if not layers:
        raise PlacementError(f"{model_dir}: no transformer layers found in its safetensors files")
    count = max(layers) + 1
    return ModelSizes(tuple(layers.get(i, 0) for i in range(count)), other)


def tensor_sizes(path: Path) -> dict[str, int]:
    """Each tensor's byte size, from a safetensors file's JSON header."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {
        name: int(meta["data_offsets"][1]) - int(meta["data_offsets"][0])
        for name, meta in header.items()
        if name != "__metadata__"
    }
