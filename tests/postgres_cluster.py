"""A throwaway PostgreSQL cluster for tests: the system's `postgresql` package, initdb /
pg_ctl in a temporary folder, listening on 127.0.0.1 only (password auth there, so the
password can travel the way users pass it: PGPASSWORD).

As root, the cluster belongs to the `postgres` user the package creates (initdb refuses
to run as root); its folder is made in the system temp folder, which that user can reach.
`start_cluster` skips the calling test with one line where that is impossible.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.system import system_missing

USER = "pipeserve"
PASSWORD = "pipeserve-test-secret"
SETTINGS = "-c fsync=off -c full_page_writes=off -c synchronous_commit=off -c max_connections=100"


def pg_bindir() -> Path | None:
    """The folder of initdb / pg_ctl: on PATH, else the newest /usr/lib/postgresql/N/bin."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(found).resolve().parent
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    return versions[-1].parent if versions else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Cluster:
    bindir: Path
    folder: Path
    port: int
    owner: str | None  # the user the server runs as when we are root

    @property
    def url(self) -> str:
        """A URL without the password (the server gets it from PGPASSWORD)."""
        return f"postgresql://{USER}@127.0.0.1:{self.port}/postgres"

    @property
    def url_with_password(self) -> str:
        return f"postgresql://{USER}:{PASSWORD}@127.0.0.1:{self.port}/postgres"

    def _run(self, *command: str, timeout: float = 120) -> None:
        prefix = ["runuser", "-u", self.owner, "--"] if self.owner else []
        done = subprocess.run(
            [*prefix, *command], capture_output=True, text=True, timeout=timeout, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout}{done.stderr}")

    def start(self) -> None:
        data, options = self.folder / "data", f"-p {self.port} -k {self.folder} {SETTINGS}"
        options += " -c listen_addresses=127.0.0.1"
        log = str(self.folder / "server.log")
        self._run(
            str(self.bindir / "pg_ctl"), "-D", str(data), "-o", options, "-l", log, "-w", "start"
        )

    def stop(self) -> None:
        data = str(self.folder / "data")
        self._run(str(self.bindir / "pg_ctl"), "-D", data, "-m", "fast", "-w", "stop")

    def wipe(self) -> None:
        """Drop pipeserve's tables (and anything else a test made) for a fresh database."""
        import psycopg

        with psycopg.connect(self.url_with_password, autocommit=True) as conn:
            conn.execute("DROP SCHEMA public CASCADE")
            conn.execute("CREATE SCHEMA public")


def _init(bindir: Path, folder: Path, owner: str | None) -> None:
    pwfile = folder / "pw"
    pwfile.write_text(PASSWORD)
    if owner:
        entry = pwd.getpwnam(owner)
        for path in (folder, pwfile):
            os.chown(path, entry.pw_uid, entry.pw_gid)
    command = [
        str(bindir / "initdb"),
        "-D",
        str(folder / "data"),
        "-U",
        USER,
        f"--pwfile={pwfile}",
        "--auth-local=trust",
        "--auth-host=scram-sha-256",
        "--no-sync",
        "-E",
        "UTF8",
    ]
    prefix = ["runuser", "-u", owner, "--"] if owner else []
    done = subprocess.run(
        [*prefix, *command], capture_output=True, text=True, timeout=180, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"initdb failed:\n{done.stdout}{done.stderr}")


def _owner() -> str | None:
    """None: run as ourselves; else the unprivileged user to run PostgreSQL as."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        system_missing("PostgreSQL tests: running as root and there is no `postgres` user")
    if shutil.which("runuser") is None:
        system_missing("PostgreSQL tests: running as root without runuser")
    return "postgres"


@contextmanager
def start_cluster() -> Iterator[Cluster]:
    bindir = pg_bindir()
    if bindir is None:
        system_missing("PostgreSQL tests: initdb not found (install the `postgresql` package)")
    owner = _owner()
    folder = Path(tempfile.mkdtemp(prefix="pipeserve-pg-"))
    cluster = Cluster(bindir, folder, free_port(), owner)
    try:
        _init(bindir, folder, owner)
        cluster.start()
        yield cluster
    finally:
        try:
            cluster.stop()
        except (RuntimeError, subprocess.TimeoutExpired):
            pass
        shutil.rmtree(folder, ignore_errors=True)
