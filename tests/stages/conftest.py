from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def harmony_encoding() -> Any:
    """The GPT-OSS Harmony encoding, loaded offline from an o200k file we write ourselves."""
    from pipeserve.engine.demo import ensure_tiktoken_base
    from pipeserve.stages.toolfmt.harmony_format import load_encoding

    ensure_tiktoken_base()
    return load_encoding()


@pytest.fixture(scope="session")
def replay_runtime(demo_model_dir: Any) -> Iterator[Callable[[str], Any]]:
    """family -> a replay-engine runtime on its demo model's real tokenizer (closed at the end)."""
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
