"""Server-wide settings from the environment (prefix PIPESERVE_).

Everything per model or per route lives in YAML; these are the knobs that select the
YAML and override where it binds, plus process-level switches.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PIPESERVE_", extra="ignore")

    config: Path = Field(Path("configs/default.yaml"), description="Server config YAML.")
    host: str | None = Field(None, description="Overrides server.host of the config.")
    port: int | None = Field(
        None, ge=0, le=65535, description="Overrides server.port (0: any free port)."
    )
    workers: int | None = Field(None, ge=1, description="Overrides server.workers.")
    home: Path | None = Field(
        None, description="Cache folder for demo models (default ~/.cache/pipeserve)."
    )
    blas: str = Field(
        "auto", description="auto: OpenBLAS on Linux when available; off: the bundled BLAS."
    )
    log_level: str | None = Field(None, description="Overrides server.log_level.")
    api_key: str | None = Field(
        None, description="When set, requests must carry it (Bearer or x-api-key)."
    )
    api_keys: str | None = Field(
        None, description="Several keys, separated by commas or whitespace (each for every model)."
    )

    def env_api_keys(self) -> list[str]:
        """Keys from PIPESERVE_API_KEY and PIPESERVE_API_KEYS, in that order."""
        keys = [self.api_key] if self.api_key else []
        keys += (self.api_keys or "").replace(",", " ").split()
        return keys


def pipeserve_home() -> Path:
    """The cache folder for demo models, converted files, kernels and the default store:
    PIPESERVE_HOME (with `~` expanded), else ~/.cache/pipeserve."""
    env = os.environ.get("PIPESERVE_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pipeserve"
