"""Where a sharded model's ranks run: the machines of its hosts file that answer now.

Every placement (at start and after each loss, in a fresh process) first asks the hosts
file's other machines over ssh, all at once; rank 0 is always this machine (host 0). The
model gets the most ranks its shapes allow (pipeline: one layer per rank at least;
tensor: heads and widths divide by the ranks) over host 0 and the machines that
answered, in hosts-file order, so a lost machine is left out and one that is back is used
again. An explicit `split` applies only when every host is used (fewer ranks: an even
split). The probe also reads each machine's MemAvailable (Linux; a machine that does not
say is not checked): a machine without room for a rank's share of the weights (the
layers split over the ranks, plus embeddings and head whole) is left out. When nothing
fits, PlacementError says why; the caller retries later.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeserve.config.models import ShardingOptions
from pipeserve.engine.sharding.hostfile import read_hostfile
from pipeserve.engine.sharding.procs import exit_codes, spawn
from pipeserve.engine.sharding.support import sharding_problems
from pipeserve.errors import PlacementError
from pipeserve.gevent_support import os_socket_class

log = logging.getLogger("pipeserve.sharding")
PROBE_TIMEOUT = 4  # seconds a machine gets to answer over ssh
FIRST_PORT = 32323
# What the probe runs on each machine: it answers (exit 0) and says its free memory.
PROBE_COMMAND = "grep -s MemAvailable /proc/meminfo; exit 0"
MEMINFO = Path("/proc/meminfo")


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
    answers = probe([str(h["ssh"]) for h in hosts[1:]], ssh_options)
    usable = [hosts[0]] + [h for h, answer in zip(hosts[1:], answers) if answer is not None]
    memory = [_available(MEMINFO.read_text() if MEMINFO.exists() else "")]
    memory += [_available(a) for a in answers if a is not None]
    lost = [str(h["ssh"]) for h, answer in zip(hosts[1:], answers) if answer is None]
    fit = Fit(options, _config(model_dir), _rank_bytes(model_dir), len(hosts))
    chosen, split, why = fit.most_ranks(usable, memory)
    if len(chosen) < 2:
        unreachable = f"unreachable over ssh: {', '.join(lost)}" if lost else "all reachable"
        raise PlacementError(f"cannot place the model on {len(usable)} of {len(hosts)} machines"
                             f" ({unreachable}){why}")  # fmt: skip
    count = len(chosen)
    first = options.port or FIRST_PORT
    ring = [[f"{h['ips'][0]}:{first + r}"] for r, h in enumerate(chosen)]
    ssh_hosts: list[str | None] = [None] + [str(h["ssh"]) for h in chosen[1:]]
    names = ", ".join(str(h["ssh"]) for h in chosen)
    unreachable = f"; unreachable: {', '.join(lost)}" if lost else ""
    log.log(logging.DEBUG if quiet else logging.INFO, "placement: %d ranks on %s%s%s", count,
            names, unreachable, why if count < len(usable) else "")  # fmt: skip
    sharding = options.model_copy(update={"ranks": count, "split": split})
    return Placement(ssh_hosts, ring, str(hosts[0]["ips"][0])), sharding


@dataclass(frozen=True)
class Fit:
    """Which machines can hold how many ranks of the model."""

    options: ShardingOptions
    config: dict[str, Any]
    rank_bytes: Callable[[int], int] | None  # weights per rank at a rank count (None: unknown)
    listed: int  # machines in the hosts file

    def most_ranks(
        self, usable: list[dict[str, Any]], memory: list[int | None]
    ) -> tuple[list[dict[str, Any]], list[int] | None, str]:
        """(machines, split, why not more) for the most ranks the shapes and memory allow;
        host 0 (this machine) first."""
        why = ""
        for count in range(len(usable), 1, -1):
            split = self.options.split if count == self.listed else None
            problems = sharding_problems(self.config, self.options.strategy, count, split)
            if problems:
                why = f"; {problems[0]}"
                continue
            need = self.rank_bytes(count) if self.rank_bytes else 0
            room = [i for i, free in enumerate(memory) if free is None or free >= need]
            if 0 in room and len(room) >= count:
                return [usable[i] for i in room[:count]], split, why
            why = f"; {_short_of(need, count, usable, memory)}"
        return [], None, why


def _short_of(need: int, count: int, usable: list[dict[str, Any]], memory: list[int | None]) -> str:
    free = ", ".join(f"{h['ssh']} {_mib(m)}" for h, m in zip(usable, memory) if m is not None)
    return (f"not enough memory: {count} ranks need {_mib(need)} each for the weights;"
            f" available: {free}")  # fmt: skip


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.0f} MiB"


def _available(meminfo: str) -> int | None:
    """MemAvailable in bytes from /proc/meminfo's text (None: not said)."""
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            fields = line.split()
            if len(fields) >= 2 and fields[1].isdigit():
                return int(fields[1]) * 1024
    return None


def _rank_bytes(model_dir: Path) -> Callable[[int], int] | None:
    """Weights a rank holds at each rank count, from the safetensors headers: the layers
    shared out (the largest share), embeddings, norm and head whole."""
    from pipeserve.cluster.placement import model_sizes

    try:
        sizes = model_sizes(model_dir)
    except (PlacementError, OSError, ValueError):
        return None
    return lambda count: sizes.other + -(-sum(sizes.layers) // count)


def probe(hosts: list[str], ssh_options: list[str]) -> list[str | None]:
    """Each host's answer over ssh now (its MemAvailable line; None: no answer), all
    asked at once."""
    ssh = shutil.which("ssh")
    if ssh is None or not hosts:
        return [None] * len(hosts)
    options = [*ssh_options, "-o", f"ConnectTimeout={PROBE_TIMEOUT}"]
    pipes = [os.pipe() for _ in hosts]
    pids = []
    for host, (_, write_end) in zip(hosts, pipes):
        argv = [ssh, *options, host, PROBE_COMMAND]
        pids.append(spawn(ssh, argv, _env(), stdout=write_end))
        os.close(write_end)
    codes = exit_codes(pids, PROBE_TIMEOUT + 4)
    answers = []
    for code, (read_end, _) in zip(codes, pipes):
        os.set_blocking(read_end, False)
        try:
            text = os.read(read_end, 1 << 16).decode(errors="replace")
        except BlockingIOError:
            text = ""
        os.close(read_end)
        answers.append(text if code == 0 else None)
    return answers


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
