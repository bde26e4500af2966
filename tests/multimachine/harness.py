"""Emulated machines on one box: Linux network namespaces on a private bridge, each
optionally with a real sshd. Reusable by any multi-machine test.

Layout (all of it inside one private network namespace made with `unshare -n`, so no
packet can leave the test: the root namespace's default route is not there):

    private namespace (pytest, clients): lo, br0 = 10.77.0.254/24
    machine i (i = 1..N): a named namespace `<prefix>-m<i>`, eth0 = 10.77.0.<i>/24,
        joined to br0 by a veth pair whose bridge end (`vm<i>`) cut() / restore() take down
        and up; with ssh, a real sshd on 10.77.0.<i>:2222 (generated keys).

`ssh m<i> CMD` works from every namespace through an `ssh` shim first on PATH (`env()`),
which points OpenSSH at the cluster's own ssh_config and key. Namespaces share the file
system and the PID space: the same venv and model folders are on every machine.

Use:

    # outer test (root namespace): runs the marked tests in a private namespace
    result = run_pytest_in_private_netns(["tests/multimachine/inner/test_x.py"], timeout=600)

    # inner test (in the private namespace, see inner/conftest.py's `cluster` fixture)
    with Cluster(3, workdir) as cluster:
        m1, m2, m3 = cluster.machines
        proc = m1.popen(["python", "-m", "http.server"], env=cluster.env())
        m2.cut(); m2.restore()
        m2.pids()            # processes running in m2's namespace
        cluster.hostfile([m1, m2], path)   # mlx's hosts file: ssh names and IPs

Named namespaces are global mounts under /run/netns even when made inside `unshare -n`:
their names carry a unique prefix and close() always deletes them (after killing every
process left inside: only this test's processes can be there).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

PRIVATE_ENV = "PIPESERVE_PRIVATE_NETNS"  # in the private namespace: "<prefix>:<outer inode>"
SSH_PORT = 2222
BRIDGE_IP = "10.77.0.254"
TOOLS = ("unshare", "ip", "ssh", "ssh-keygen")
SSHD = "/usr/sbin/sshd"
ENTER_TIMEOUT = 10.0  # seconds a started process may take to enter its namespace


def missing() -> str | None:
    """Why machines cannot be emulated here (None: they can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    absent = [tool for tool in TOOLS if shutil.which(tool) is None]
    if not Path(SSHD).exists():
        absent.append("sshd (openssh-server)")
    return f"missing tools: {', '.join(absent)}" if absent else None


def in_private_netns() -> bool:
    """Inside the private namespace run_pytest_in_private_netns made."""
    prefix, _, outer = os.environ.get(PRIVATE_ENV, "").partition(":")
    return bool(prefix and outer) and os.stat("/proc/self/ns/net").st_ino != int(outer)


def run_pytest_in_private_netns(
    args: list[str], timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run pytest on `args` in a fresh private network namespace; always removes the
    named namespaces it made (even when the run is killed)."""
    prefix = f"ps{os.getpid() % 100000}{secrets.token_hex(2)}"
    outer = os.stat("/proc/self/ns/net").st_ino
    full_env = {**os.environ, **(env or {}), PRIVATE_ENV: f"{prefix}:{outer}"}
    command = ["unshare", "-n", "--", sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    try:
        return subprocess.run(
            command + args, env=full_env, capture_output=True, text=True, timeout=timeout
        )
    finally:
        remove_namespaces(prefix)


def remove_namespaces(prefix: str) -> None:
    """Kill what runs in, then delete, every named namespace whose name starts with prefix."""
    folder = Path("/run/netns")
    for path in folder.glob(f"{prefix}-*") if folder.is_dir() else []:
        kill_in_namespace(path.stat().st_ino)
        subprocess.run(["ip", "netns", "del", path.name], capture_output=True)


def namespace_of(pid: int) -> int | None:
    """The network namespace (inode) of a process; None when it is gone."""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def pids_in_namespace(inode: int) -> list[int]:
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    return [pid for pid in pids if namespace_of(pid) == inode and not _zombie(pid)]


def kill_in_namespace(inode: int) -> None:
    for _ in range(20):
        pids = pids_in_namespace(inode)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


@dataclass
class Machine:
    """One emulated machine: a named network namespace on the bridge."""

    number: int
    netns: str
    ip: str
    veth: str  # the bridge end of its link, in the private namespace
    ssh: bool = False
    sshd: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        """Its ssh host name (`ssh m2 ...`)."""
        return f"m{self.number}"

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv]

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` in this machine; returns once the process is inside its namespace
        (`ip netns exec` switches after the fork: on a busy machine, pids() and
        machine_of() could otherwise still see it outside), or has already ended."""
        proc = subprocess.Popen(self.command(argv), **kwargs)
        inode, deadline = self.inode(), time.monotonic() + ENTER_TIMEOUT
        while namespace_of(proc.pid) != inode and proc.poll() is None:
            if time.monotonic() > deadline:
                break  # the caller's own checks say what went wrong
            time.sleep(0.01)
        return proc

    def run(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        return subprocess.run(self.command(argv), **kwargs)

    def inode(self) -> int:
        return os.stat(f"/run/netns/{self.netns}").st_ino

    def pids(self) -> list[int]:
        """Processes running in this machine's namespace now."""
        return pids_in_namespace(self.inode())

    def cut(self) -> None:
        """Pull the machine's network cable (its processes keep running)."""
        _run("ip", "link", "set", self.veth, "down")

    def restore(self) -> None:
        _run("ip", "link", "set", self.veth, "up")


class Cluster:
    """`count` machines on a private bridge; `ssh`: a real sshd on each."""

    def __init__(self, count: int, workdir: Path, ssh: bool = True) -> None:
        prefix = os.environ.get(PRIVATE_ENV, "").partition(":")[0]
        if not in_private_netns():
            raise RuntimeError("Cluster runs only inside run_pytest_in_private_netns")
        self.prefix = f"{prefix}{secrets.token_hex(2)}"
        self.workdir = workdir
        self.machines: list[Machine] = []
        self._bridge()
        try:
            for number in range(1, count + 1):
                self._machine(number, ssh)
            if ssh:
                self._ssh_setup()
                for machine in self.machines:
                    self._start_sshd(machine)
                for machine in self.machines:
                    wait_port(machine.ip, SSH_PORT)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        self.close()

    # -- building -------------------------------------------------------------------

    def _bridge(self) -> None:
        _run("ip", "link", "set", "lo", "up")
        if not Path("/sys/class/net/br0").exists():
            _run("ip", "link", "add", "br0", "type", "bridge")
            _run("ip", "addr", "add", f"{BRIDGE_IP}/24", "dev", "br0")
            _run("ip", "link", "set", "br0", "up")

    def _machine(self, number: int, ssh: bool) -> None:
        netns, veth = f"{self.prefix}-m{number}", f"vm{number}"
        _run("ip", "netns", "add", netns)
        machine = Machine(number, netns, f"10.77.0.{number}", veth, ssh)
        self.machines.append(machine)  # close() deletes it even if the rest fails
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _run("ip", "link", "set", veth, "master", "br0", "up")
        _run("ip", "-n", netns, "addr", "add", f"{machine.ip}/24", "dev", "eth0")
        _run("ip", "-n", netns, "link", "set", "eth0", "up")
        _run("ip", "-n", netns, "link", "set", "lo", "up")

    def _ssh_setup(self) -> None:
        folder = self.ssh_dir = self.workdir / "ssh"
        (folder / "bin").mkdir(parents=True, exist_ok=True)
        for key in ("id", "hostkey"):
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / key))
        shutil.copy(folder / "id.pub", folder / "authorized_keys")
        hosts = "".join(f"Host {m.name}\n  HostName {m.ip}\n" for m in self.machines)
        (folder / "ssh_config").write_text(
            hosts + f"Host *\n  Port {SSH_PORT}\n  User root\n  IdentityFile {folder / 'id'}\n"
            "  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
            "  BatchMode yes\n  LogLevel ERROR\n"
        )
        shim = folder / "bin" / "ssh"
        shim.write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {folder / "ssh_config"} "$@"\n')
        shim.chmod(0o755)
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation folder

    def _start_sshd(self, machine: Machine) -> None:
        folder = self.ssh_dir
        config = folder / f"sshd-{machine.name}.conf"
        config.write_text(
            f"Port {SSH_PORT}\nListenAddress {machine.ip}\nHostKey {folder / 'hostkey'}\n"
            f"AuthorizedKeysFile {folder / 'authorized_keys'}\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
            f"PermitRootLogin prohibit-password\nPidFile {folder / f'sshd-{machine.name}.pid'}\n"
            "ClientAliveInterval 2\nClientAliveCountMax 3\n"
        )
        with open(folder / f"sshd-{machine.name}.log", "wb") as log:
            argv = [SSHD, "-D", "-e", "-f", str(config)]
            machine.sshd = machine.popen(argv, stdout=log, stderr=subprocess.STDOUT)

    # -- using ----------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """os.environ with the ssh shim first on PATH (for processes that use ssh)."""
        path = os.environ.get("PATH", "")
        if not getattr(self, "ssh_dir", None):
            return dict(os.environ)
        return {**os.environ, "PATH": f"{self.ssh_dir / 'bin'}:{path}"}

    def hostfile(self, machines: list[Machine], path: Path) -> Path:
        """mlx's hosts file: rank i on machines[i] (ssh name, IP)."""
        hosts = [{"ssh": m.name, "ips": [m.ip]} for m in machines]
        path.write_text(json.dumps({"hosts": hosts}))
        return path

    def machine_of(self, pid: int) -> Machine | None:
        """Which machine a process runs in (None: not in any of them)."""
        inode = namespace_of(pid)
        return next((m for m in self.machines if m.inode() == inode), None)

    def close(self) -> None:
        for machine in self.machines:
            if Path(f"/run/netns/{machine.netns}").exists():
                kill_in_namespace(machine.inode())
                subprocess.run(["ip", "netns", "del", machine.netns], capture_output=True)
            if machine.sshd is not None:
                machine.sshd.wait()
        self.machines = []


def wait_port(ip: str, port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((ip, port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
