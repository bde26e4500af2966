"""Where a sharded model's ranks run: the machines of its hosts file that answer now.

Every placement (at start and after each loss, in a fresh process) first asks the hosts
file's other machines over ssh, all at once; rank 0 is always this machine (host 0). The
model gets the most ranks its shapes allow (pipeline: one layer per rank at least;
tensor: heads and widths divide by the ranks) over host 0 and the machines that
answered, in hosts-file order, so a lost machine is left out and one that is back is used
again. An explicit `split` applies only when every host is used (fewer ranks: an even
split). When nothing fits, PlacementError says why; the caller retries later.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeserve.config.models import ShardingOptions
from pipeserve.engine.sharding.control import os_socket_class
from pipeserve.engine.sharding.hostfile import read_hostfile
from pipeserve.engine.sharding.procs import exit_codes, spawn
from pipeserve.engine.sharding.support import sharding_problems

log = logging.getLogger("pipeserve.sharding")
PROBE_TIMEOUT = 4  # seconds a machine gets to answer over ssh
FIRST_PORT = 32323


class PlacementError(RuntimeError):
    """The model cannot be placed now (machines unreachable, or too few for its shapes)."""


@dataclass(frozen=True)
class Placement:
    """Where each rank runs: ssh host (None: this machine) and its ring address."""

    ssh_hosts: list[str | None]
    ring: list[list[str]]  # mx.distributed ring hostfile: per rank, its "ip:port"s
    control_ip: str  # where rank 0 listens for the other ranks


def place(
    options: ShardingOptions, model_dir: Path, ssh_options: list[str], quiet: bool = False
) -> tuple[Placement, ShardingOptions]:
    """This placement and the sharding options it runs with (ranks, split); `quiet`: a
    check that logs nothing."""
    if not options.hostfile:
        size = options.size
        ports = [options.port + r for r in range(size)] if options.port else _free_ports(size)
        return Placement([None] * size, [[f"127.0.0.1:{p}"] for p in ports], "127.0.0.1"), options
    hosts, problem = read_hostfile(Path(options.hostfile))
    if problem:
        raise PlacementError(problem)
    answers = reachable([str(h["ssh"]) for h in hosts[1:]], ssh_options)
    usable = [hosts[0]] + [h for h, ok in zip(hosts[1:], answers) if ok]
    lost = [str(h["ssh"]) for h, ok in zip(hosts[1:], answers) if not ok]
    count, split, why = _most_ranks(options, _config(model_dir), len(usable), len(hosts))
    if count < 2:
        unreachable = f"unreachable over ssh: {', '.join(lost)}" if lost else "all reachable"
        raise PlacementError(f"cannot place the model on {len(usable)} of {len(hosts)} machines"
                             f" ({unreachable}){why}")  # fmt: skip
    chosen = usable[:count]
    first = options.port or FIRST_PORT
    ring = [[f"{h['ips'][0]}:{first + r}"] for r, h in enumerate(chosen)]
    ssh_hosts: list[str | None] = [None] + [str(h["ssh"]) for h in chosen[1:]]
    names = ", ".join(str(h["ssh"]) for h in chosen)
    unreachable = f"; unreachable: {', '.join(lost)}" if lost else ""
    log.log(logging.DEBUG if quiet else logging.INFO, "placement: %d ranks on %s%s", count,
            names, unreachable)  # fmt: skip
    sharding = options.model_copy(update={"ranks": count, "split": split})
    return Placement(ssh_hosts, ring, str(hosts[0]["ips"][0])), sharding


def _most_ranks(
    options: ShardingOptions, config: dict[str, Any], usable: int, listed: int
) -> tuple[int, list[int] | None, str]:
    """(ranks, split, why fewer) for the most ranks the model's shapes allow on `usable`."""
    why = ""
    for count in range(usable, 1, -1):
        split = options.split if count == listed else None
        problems = sharding_problems(config, options.strategy, count, split)
        if not problems:
            return count, split, ""
        why = why or f"; {problems[0]}"
    return 0, None, why


def reachable(hosts: list[str], ssh_options: list[str]) -> list[bool]:
    """Whether each host answers over ssh now (all asked at once)."""
    ssh = shutil.which("ssh")
    if ssh is None or not hosts:
        return [False] * len(hosts)
    options = [*ssh_options, "-o", f"ConnectTimeout={PROBE_TIMEOUT}"]
    pids = [spawn(ssh, [ssh, *options, host, "true"], _env()) for host in hosts]
    return [code == 0 for code in exit_codes(pids, PROBE_TIMEOUT + 4)]


def _env() -> dict[str, str]:
    return dict(os.environ)


def _config(model_dir: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    return data


def _free_ports(count: int) -> list[int]:
    socks, ports = [], []
    for _ in range(count):
        sock = os_socket_class()()
        sock.bind(("127.0.0.1", 0))
        socks.append(sock)
        ports.append(sock.getsockname()[1])
    for sock in socks:
        sock.close()
    return ports
