"""Model folders built once on disk, safely when several processes ask at the same time."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def build_folder_once(target: Path, prefix: str, build: Callable[[Path], None]) -> Path:
    """`target` (a model folder, complete once it has a config.json), built by `build`
    into a temporary folder beside it (named `prefix...`) and renamed into place: a
    process that loses the race to another keeps the winner's folder."""
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=prefix))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
