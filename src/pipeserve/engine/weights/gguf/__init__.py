"""GGUF files as model sources: converted once into an mlx-lm model folder.

    folder = ensure_converted(Path("model.gguf"))   # <home>/gguf/<stem>-<sha256[:16]>-v2/

The folder is keyed by the file's sha256 (a changed file is converted anew), built in
a temporary folder and renamed into place like the demo models, and loadable by
mlx-lm itself (`mlx_lm.server --model <folder>` serves the very same weights).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from pipeserve.engine.weights.folders import build_folder_once
from pipeserve.engine.weights.gguf.files import (
    GgufError,
    check_gguf_file,
    file_sha256,
    is_gguf_source,
)
from pipeserve.engine.weights.memory import release_free_memory

log = logging.getLogger("pipeserve.engine")

CONVERTER_VERSION = 4  # bump when the converter's output changes; old folders are ignored

__all__ = ["GgufError", "check_gguf_file", "ensure_converted", "file_sha256", "is_gguf_source"]


def converted_dir(path: Path, sha256: str, home: Path) -> Path:
    return home / "gguf" / f"{path.stem}-{sha256[:16]}-v{CONVERTER_VERSION}"


def ensure_converted(path: Path, home: Path, sha256: str | None = None) -> Path:
    """The mlx-lm folder of GGUF `path`, converting first when missing.

    `sha256`, when given, must match the file (else GgufError).
    """
    check_gguf_file(path)
    actual = file_sha256(path)
    if sha256 is not None and actual != sha256.lower():
        raise GgufError(f"{path}: sha256 is {actual}, but the config expects {sha256.lower()}")
    target = converted_dir(path, actual, home)
    if (target / "config.json").exists():
        return target
    started = time.monotonic()

    def build(tmp: Path) -> None:
        from pipeserve.engine.weights.gguf.convert import convert

        log.info("converting %s into an mlx-lm model folder %s", path, target)
        convert(path, tmp)

    build_folder_once(target, f".{target.name}-build-", build)
    release_free_memory()  # the conversion's garbage: ~115 MB of RSS for a 98 MB file
    log.info("converted %s in %.1f s", path.name, time.monotonic() - started)
    return target
