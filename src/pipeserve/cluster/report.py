"""What a machine offers a sharded model: its memory, MLX backend, device and versions.

Computed the same way by a node (its `GET /v1/node` answer) and by the serving machine
for rank 0, so placement compares like with like.
"""

from __future__ import annotations

import platform
import socket
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from pipeserve import __version__
from pipeserve.cluster.placement import Machine


def available_memory() -> tuple[int, str]:
    """(bytes a model may use here, what they are): a GPU's memory where MLX runs on one,
    else the RAM the kernel reports available."""
    import mlx.core as mx

    if mx.default_device() == mx.gpu:
        size = mx.device_info().get("memory_size")
        if isinstance(size, int) and size > 0:
            return size, "GPU memory"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "available RAM"
    except OSError:
        pass
    from pipeserve.config.memory import total_ram

    return total_ram(), "RAM"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine_report(memory: int | None) -> dict[str, Any]:
    """This machine's report; `memory` overrides the memory it offers (--memory)."""
    from pipeserve.backend import describe_device, installed_backends

    found, what = available_memory()
    backends = sorted(set(installed_backends().values())) or ["bundled"]
    device = describe_device()
    return {
        "hostname": socket.gethostname(),
        "memory": {
            "found": found,
            "found_kind": what,
            "usable": memory if memory is not None else found,
            "override": memory is not None,
        },
        "device": device.split(" ", 1)[0],
        "device_name": device,
        "backend": ",".join(backends),
        "versions": {
            "pipeserve": __version__,
            "mlx": _version("mlx"),
            "mlx-lm": _version("mlx-lm"),
            "python": platform.python_version(),
        },
        "platform": sys.platform,
    }


def as_machine(address: str, report: dict[str, Any]) -> Machine:
    return Machine(
        address=address,
        usable=int(report["memory"]["usable"]),
        device=str(report["device"]),
        backend=str(report["backend"]),
        mlx=str(report["versions"]["mlx"]),
    )
