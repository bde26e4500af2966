"""Where a config's pipelines are: `pipelines_dir` when the config sets it (relative to
the config file), else `../pipelines` beside the config's folder when there is one (the
repository's layout), else the pipelines shipped inside the package (the repository's
`pipelines/`, installed as package data), so a config in any folder finds `chatml`,
`qwen3` ... and `pipeline: auto` without naming a folder."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

DEFAULT_DIR = "../pipelines"


def shipped_pipelines() -> Path:
    """The pipelines installed with pipeserve."""
    return Path(str(files("pipeserve") / "pipelines"))


def pipeline_folder(config_path: Path, pipelines_dir: str | None) -> Path:
    """The folder of pipeline files a config uses (`pipelines_dir` None: not set)."""
    if pipelines_dir is not None:
        return config_path.parent / pipelines_dir
    beside = config_path.parent / DEFAULT_DIR
    return beside if beside.is_dir() else shipped_pipelines()
