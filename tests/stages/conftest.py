from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def harmony_encoding() -> Any:
    """The GPT-OSS Harmony encoding, loaded offline from an o200k file we write ourselves."""
    from pipeserve.engine.weights.demo.build import ensure_tiktoken_base
    from pipeserve.stages.toolfmt.harmony_format import load_encoding

    ensure_tiktoken_base()
    return load_encoding()
