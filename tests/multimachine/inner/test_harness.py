"""The harness itself: ssh reaches each machine's own namespace, and a cut link cuts."""

from __future__ import annotations

import os
import subprocess

from tests.multimachine.harness import Cluster


def test_ssh_runs_in_the_target_machine_and_a_cut_link_is_unreachable(cluster: Cluster) -> None:
    m1, m2, m3 = cluster.machines
    probe = ["ssh", "-o", "ConnectTimeout=3", m2.name, "readlink /proc/self/ns/net"]
    done = m1.run(probe, env=cluster.env(), capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"net:[{m2.inode()}]"
    assert len({m.inode() for m in cluster.machines} | {os.stat("/proc/self/ns/net").st_ino}) == 4
    m2.cut()
    try:
        done = m1.run(probe, env=cluster.env(), capture_output=True, timeout=30)
        assert done.returncode != 0
        sleeper = m3.popen(["sleep", "60"])
        assert sleeper.pid in m3.pids() and sleeper.pid not in m2.pids()
        assert cluster.machine_of(sleeper.pid) is m3
        sleeper.kill()
        sleeper.wait()
    finally:
        m2.restore()
    done = m1.run(probe, env=cluster.env(), capture_output=True, timeout=30)
    assert done.returncode == 0
    assert (
        subprocess.run(["ip", "route"], capture_output=True, text=True).stdout.count("default") == 0
    )
