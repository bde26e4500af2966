"""Cheap facts about a GGUF file, without reading its tensors (used by validation too)."""

from __future__ import annotations

import hashlib
from pathlib import Path

GGUF_MAGIC = b"GGUF"
_CHUNK = 1 << 20


class GgufError(ValueError):
    """A GGUF file that cannot be served (message: one line)."""


def is_gguf_source(source: str) -> bool:
    return source.lower().endswith(".gguf")


def check_gguf_file(path: Path) -> None:
    """Raise GgufError unless `path` exists and starts with the GGUF magic."""
    if not path.is_file():
        raise GgufError(f"GGUF file {path} does not exist")
    with path.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise GgufError(f"{path} is not a GGUF file (no GGUF magic at its start)")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
