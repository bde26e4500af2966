"""Finding the nodes of a cluster on the LAN: mDNS / DNS-SD with python-zeroconf.

A node announces `_pipeserve._tcp.local.` with its cluster name in the TXT record; the
serving machine browses for that type for a few seconds and keeps the nodes of its own
cluster. What is found is only an address: every node is then asked for its report with
the cluster token, so an announcement proves nothing by itself.

In a gunicorn gevent worker, zeroconf's threads and asyncio loop would run under
gevent's patches; rank 0 browses in a short child process instead
(`python -m pipeserve.cluster.discovery`), which prints the addresses as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from typing import Any

SERVICE_TYPE = "_pipeserve._tcp.local."


class Announcement:
    """A node's mDNS record, announced until close()."""

    def __init__(self, cluster: str, port: int, addresses: list[str], version: str) -> None:
        from zeroconf import InterfaceChoice, IPVersion, ServiceInfo, Zeroconf

        host = socket.gethostname().split(".")[0] or "node"
        label = f"{host}-{addresses[0].replace('.', '-').replace(':', '-')}-{port}"
        self.info = ServiceInfo(
            SERVICE_TYPE,
            f"{label}.{SERVICE_TYPE}",
            port=port,
            parsed_addresses=addresses,
            properties={"cluster": cluster, "version": version},
            server=f"{label}.local.",
        )
        self.zeroconf = Zeroconf(interfaces=InterfaceChoice.All, ip_version=IPVersion.V4Only)
        self.zeroconf.register_service(self.info, allow_name_change=True)

    def close(self) -> None:
        try:
            self.zeroconf.unregister_service(self.info)
        finally:
            self.zeroconf.close()


def own_addresses() -> list[str]:
    """This machine's IPv4 addresses other than loopback (what a node announces)."""
    import ifaddr  # zeroconf's own dependency for the same question

    found = [ip.ip for adapter in ifaddr.get_adapters() for ip in adapter.ips if ip.is_IPv4]
    return [str(a) for a in found if not str(a).startswith("127.")]


def browse(cluster: str, timeout: float) -> list[str]:
    """host:port of every node of `cluster` that answers within `timeout` seconds."""
    from zeroconf import InterfaceChoice, IPVersion, ServiceBrowser, ServiceListener, Zeroconf

    names: set[str] = set()

    class Listener(ServiceListener):
        def add_service(self, zc: Any, type_: str, name: str) -> None:
            names.add(name)

        def update_service(self, zc: Any, type_: str, name: str) -> None:
            names.add(name)

        def remove_service(self, zc: Any, type_: str, name: str) -> None:
            names.discard(name)

    zeroconf = Zeroconf(interfaces=InterfaceChoice.All, ip_version=IPVersion.V4Only)
    try:
        browser = ServiceBrowser(zeroconf, SERVICE_TYPE, Listener())
        time.sleep(timeout)
        browser.cancel()
        found = []
        for name in sorted(names):
            info = zeroconf.get_service_info(SERVICE_TYPE, name, timeout=1500)
            if info is None or info.port is None:
                continue
            props = {k.decode(): (v or b"").decode() for k, v in info.properties.items()}
            addresses = info.parsed_addresses()
            if props.get("cluster") == cluster and addresses:
                found.append(f"{addresses[0]}:{info.port}")
        return sorted(set(found))
    finally:
        zeroconf.close()


def discover(cluster: str, timeout: float) -> list[str]:
    """The nodes of `cluster` on the LAN (host:port); in a child process under gevent."""
    from pipeserve.gevent_support import gevent_patched

    return browse_in_child(cluster, timeout) if gevent_patched() else browse(cluster, timeout)


def browse_in_child(cluster: str, timeout: float) -> list[str]:
    """browse() in a child process (safe from a gevent worker's OS thread)."""
    from pipeserve.child_env import child_environment
    from pipeserve.gevent_support import unpatched_os as _unpatched_os

    with tempfile.TemporaryFile() as out:
        argv = [sys.executable, "-m", __name__, "--cluster", cluster, "--timeout", str(timeout)]
        redirect = [(os.POSIX_SPAWN_DUP2, out.fileno(), 1), (os.POSIX_SPAWN_DUP2, out.fileno(), 2)]
        spawn = _unpatched_os("posix_spawn")
        pid = spawn(sys.executable, argv, child_environment(), file_actions=redirect)
        _, status = _unpatched_os("waitpid")(pid, 0)
        out.seek(0)
        text = out.read().decode(errors="replace")
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"node discovery failed: {text.strip()[-300:]}")
    return [str(a) for a in json.loads(text.strip().splitlines()[-1])]


def main() -> int:
    parser = argparse.ArgumentParser(description="print the nodes of a cluster as JSON")
    parser.add_argument("--cluster", default="default")
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args()
    print(json.dumps(browse(args.cluster, args.timeout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
