"""mlx's hosts file for a sharded model, read by config validation and by the group start."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_hostfile(path: Path) -> tuple[list[dict[str, Any]], str | None]:
    """mlx's hosts file: {"hosts": [{"ssh": ..., "ips": [...]}, ...]} or the bare list."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return [], f"cannot read the hosts file {path}: {exc}"
    hosts = data.get("hosts") if isinstance(data, dict) else data
    if not isinstance(hosts, list) or not all(isinstance(h, dict) for h in hosts):
        return [], f"{path}: expected mlx's hosts file format (a 'hosts' list of {{ssh, ips}})"
    if len(hosts) < 2:
        return [], f"{path}: a sharded model needs at least 2 hosts, found {len(hosts)}"
    for number, host in enumerate(hosts):
        if not isinstance(host.get("ssh"), str) or not host.get("ips"):
            return [], f"{path}: host {number} needs 'ssh' (a host name) and 'ips' (the ring's IPs)"
    return hosts, None
