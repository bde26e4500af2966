"""Model files from the serving machine to the nodes that lack them.

The serving machine lists its model folder (name, size, sha256 and, for safetensors
files, which layers each holds) and serves those files, and only those, over HTTP to
nodes that sign their requests with the cluster token (auth.py) while a group starts
(FileServer). A node keeps its copy in a folder of its own named by the list's hash,
fetches only the files it lacks that hold its layers (plus the small non-weight files),
and checks every file's sha256 (from the signed assignment) before use; a file that does
not match is deleted and the assignment fails.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import re
from dataclasses import dataclass, field
from functools import partial
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pipeserve.cluster.auth import RequestVerifier, endpoint
from pipeserve.cluster.limits import ConnectionLimits
from pipeserve.cluster.placement import LAYER_NAME, tensor_sizes
from pipeserve.cluster.wire import NodeUnreachable, open_download
from pipeserve.engine.sharding.load import PARTIAL_MARKER
from pipeserve.gevent_support import os_socket_class, start_os_thread

log = logging.getLogger("pipeserve.cluster")

SAFE_NAME = r"^[A-Za-z0-9_][A-Za-z0-9._-]*$"
CHUNK = 1 << 20
# Connections to the file server before their request is verified (limits.py); a verified
# transfer may take longer: the deadline is lifted once its request checks.
FILE_CONNECTIONS = 32
FILE_CONNECTIONS_PER_ADDRESS = 8
REQUEST_DEADLINE = 10.0
_HASHES: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256


class ModelFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=SAFE_NAME, max_length=200)
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    layers: list[int] | None = None  # safetensors: the layers it holds
    other: bool = True  # holds something that is not a layer (every rank needs it)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _cached_sha256(path: Path) -> str:
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _HASHES:
        _HASHES[key] = sha256_file(path)
    return _HASHES[key]


def manifest(model_dir: Path) -> list[ModelFile]:
    """The files of a model folder (top level, no hidden files), hashed once per version."""
    files = []
    for path in sorted(model_dir.iterdir()):
        if not path.is_file() or not re.match(SAFE_NAME, path.name):
            continue
        entry = ModelFile(name=path.name, size=path.stat().st_size, sha256=_cached_sha256(path))
        if path.suffix == ".safetensors":
            names = tensor_sizes(path)
            held = {int(m.group(1)) for n in names if (m := LAYER_NAME.search(n))}
            entry.layers = sorted(held)
            entry.other = any(not LAYER_NAME.search(n) for n in names)
        files.append(entry)
    return files


def needed(files: list[ModelFile], layers: tuple[int, int] | None) -> list[ModelFile]:
    """The files a rank holding `layers` ([start, end); None: a slice of all) must have."""
    if layers is None:
        return list(files)
    wanted = set(range(*layers))
    return [f for f in files if f.layers is None or f.other or wanted & set(f.layers)]


def folder_key(files: list[ModelFile]) -> str:
    listing = json.dumps([f.model_dump() for f in files], sort_keys=True).encode()
    return hashlib.sha256(listing).hexdigest()[:20]


@dataclass
class FetchReport:
    fetched: list[str] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)
    fetched_bytes: int = 0


def fetch_model(
    folder: Path,
    files: list[ModelFile],
    layers: tuple[int, int] | None,
    source: tuple[str, int],
    token: str,
) -> FetchReport:
    """Make `folder` hold every file this rank needs, each checked against its sha256."""
    folder.mkdir(parents=True, exist_ok=True)
    report = FetchReport()
    wanted = needed(files, layers)
    for entry in wanted:
        target = folder / entry.name
        if target.is_file() and target.stat().st_size == entry.size:
            if _cached_sha256(target) == entry.sha256:
                report.reused.append(entry.name)
                continue
        _download(entry, target, source, token)
        report.fetched.append(entry.name)
        report.fetched_bytes += entry.size
    skipped = len(files) - len(wanted)
    marker = folder / PARTIAL_MARKER
    if skipped:
        marker.write_text("weight files of other ranks' layers are not here\n")
    else:
        marker.unlink(missing_ok=True)
    return report


def _download(entry: ModelFile, target: Path, source: tuple[str, int], token: str) -> None:
    partial = target.with_name(f".{entry.name}.part")
    digest = hashlib.sha256()
    conn, response = open_download(source[0], source[1], f"/files/{entry.name}", token)
    try:
        if response.length != entry.size:  # never more than the signed manifest's size
            raise ValueError(
                f"{entry.name} from {source[0]}:{source[1]}: {response.length} bytes announced,"
                f" {entry.size} expected"
            )
        left = entry.size
        with open(partial, "wb") as out:
            while left and (chunk := response.read(min(CHUNK, left))):
                digest.update(chunk)
                out.write(chunk)
                left -= len(chunk)
    except http.client.HTTPException as exc:  # a broken answer: as a lost connection
        partial.unlink(missing_ok=True)
        raise NodeUnreachable(f"{entry.name} from {source[0]}:{source[1]}: {exc!r}") from exc
    finally:
        conn.close()
    if digest.hexdigest() != entry.sha256:
        partial.unlink(missing_ok=True)
        raise ValueError(
            f"{entry.name} from {source[0]}:{source[1]} failed its sha256 check"
            f" (got {digest.hexdigest()[:12]}..., expected {entry.sha256[:12]}...)"
        )
    partial.replace(target)
    log.info("fetched %s (%d bytes, sha256 verified)", entry.name, entry.size)


class FileServer:
    """The serving machine's model files, for signed requests only, while a group starts."""

    def __init__(self, ip: str, token: str, model_dir: Path, files: list[ModelFile]) -> None:
        self.ip = ip
        self.verifier = RequestVerifier(token)
        self.paths = {f.name: model_dir / f.name for f in files}
        self.limits = ConnectionLimits(FILE_CONNECTIONS, FILE_CONNECTIONS_PER_ADDRESS,
                                       REQUEST_DEADLINE)  # fmt: skip
        self.verified = ConnectionLimits(FILE_CONNECTIONS, FILE_CONNECTIONS, float("inf"))
        sock = os_socket_class()()
        sock.bind((ip, 0))
        sock.listen(16)
        self._listener = sock
        self.port = int(sock.getsockname()[1])
        self._open = True
        start_os_thread(self._accept_loop, name="pipeserve-cluster-files")

    def _accept_loop(self) -> None:
        while self._open:
            try:
                # _accept: a plain OS socket even where gevent patched socket.accept
                fd, peer = self._listener._accept()
            except OSError:
                return
            conn = os_socket_class()(fileno=fd)
            if not self.limits.admit(conn, str(peer[0])):
                conn.close()
                continue
            start_os_thread(partial(self._serve, conn, peer), name="pipeserve-cluster-file")

    def _serve(self, conn: Any, peer: Any) -> None:
        try:
            conn.settimeout(60.0)
            _FileHandler(conn, peer, self)  # type: ignore[arg-type]  # only .verifier/.paths are read
        except OSError as exc:
            log.warning("model file transfer to %s failed: %s", peer[0], exc)
        finally:
            self.limits.release(conn)
            self.verified.release(conn)
            conn.close()

    def close(self) -> None:
        self._open = False
        try:
            self._listener.close()
        except OSError:
            pass


class _FileHandler(BaseHTTPRequestHandler):
    server: Any  # the FileServer
    protocol_version = "HTTP/1.0"

    def do_GET(self) -> None:
        owner: FileServer = self.server
        local = endpoint(self.connection.getsockname())
        header = self.headers.get("Authorization")
        _, problem = owner.verifier.check(header, "GET", self.path, b"", local=local)
        if problem is None:  # a verified transfer: out of the unverified connections' bounds
            owner.limits.release(self.connection)
            owner.verified.admit(self.connection, str(self.client_address[0]))
        if problem is not None:
            log.info("refused a model file request from %s: %s", self.client_address[0], problem)
            self.send_error(401, problem)
            return
        name = self.path.removeprefix("/files/")
        path = owner.paths.get(name)
        if not self.path.startswith("/files/") or path is None:
            self.send_error(404, "no such model file")
            return
        size = path.stat().st_size
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(size))
        self.end_headers()
        with open(path, "rb") as f:
            self.connection.sendfile(f)
        log.info("sent %s (%d bytes) to node %s", name, size, self.client_address[0])

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("files: " + format, *args)
