"""Processes of a sharded model's group, started and reaped with the OS's own calls.

Rank 0's side runs on OS threads of a process gevent may have patched; gevent's `os` and
`subprocess` need the hub of the main thread, so these use the unpatched originals.
"""

from __future__ import annotations

import os
import time

from pipeserve.gevent_support import os_sleep, unpatched_os


def spawn(
    path: str,
    argv: list[str],
    env: dict[str, str],
    stdin: int | None = None,
    stdout: int | None = None,
) -> int:
    """Start a process in a session of its own (a signal to pipeserve's process group,
    a Ctrl-C or a service manager's SIGTERM, does not reach it); `stdin`, `stdout`: file
    descriptors it gets as those (else this process's)."""
    actions = [(os.POSIX_SPAWN_DUP2, fd, target)
               for fd, target in ((stdin, 0), (stdout, 1)) if fd is not None]  # fmt: skip
    return int(unpatched_os("posix_spawn")(path, argv, env, file_actions=actions, setsid=True))


def reap(pid: int) -> int | None:
    """The exit code of a child that has ended (reaping it), else None."""
    try:
        done, status = unpatched_os("waitpid")(pid, os.WNOHANG)
    except ChildProcessError:
        return -1
    return os.waitstatus_to_exitcode(status) if done else None


def exit_codes(pids: list[int], timeout: float) -> list[int | None]:
    """Wait up to `timeout` for the children to end; None for those still running (killed)."""
    codes: dict[int, int | None] = dict.fromkeys(pids)
    deadline = time.monotonic() + timeout
    while any(c is None for c in codes.values()) and time.monotonic() < deadline:
        os_sleep(0.05)
        for pid in [p for p, c in codes.items() if c is None]:
            codes[pid] = reap(pid)
    for pid in [p for p, c in codes.items() if c is None]:
        os.kill(pid, 9)
        reap(pid)
    return [codes[pid] for pid in pids]
