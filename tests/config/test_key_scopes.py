"""server.api_keys: a key scoped to a model that does not exist is a positioned problem."""

from __future__ import annotations

from pipeserve.config import validate_paths
from tests.config.conftest import GOOD_CONFIG, GOOD_PIPELINE, Tree


def test_a_key_scoped_to_an_unknown_model_is_a_positioned_problem(tree: Tree) -> None:
    tree.write("pipelines/qwen3.yaml", GOOD_PIPELINE)
    text = GOOD_CONFIG.replace(
        "server: {host: 127.0.0.1, port: 8080}",
        "server:\n  api_keys:\n    - {key: k1, models: [demo, dmeo]}",
    )
    path = tree.write("configs/default.yaml", text)
    problems = [str(p) for p in validate_paths([path]).problems]
    assert problems == [
        "configs/default.yaml:3:32: server.api_keys[0].models[1]: no model named 'dmeo'; did you mean 'demo'?"
    ]
