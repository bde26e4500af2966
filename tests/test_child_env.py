"""Child processes get an allow-listed environment without pipeserve's secrets (issue 34):
before, local ranks and the discovery child inherited the cluster token and API keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeserve.child_env import child_environment
from pipeserve.cluster.node import NodeAgent

SECRET_ENV = {
    "PIPESERVE_CLUSTER_TOKEN": "cluster-secret-0123456789",
    "PIPESERVE_API_KEY": "sk-legacy-secret",
    "PIPESERVE_API_KEYS": "sk-one-secret, sk-two-secret",
    "PGPASSWORD": "db-secret",
    "AWS_SECRET_ACCESS_KEY": "cloud-secret",
}


def test_a_child_gets_what_it_needs_and_no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SECRET_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MLX_RANK", "3")
    monkeypatch.setenv("PIPESERVE_HOME", "/srv/pipeserve")
    env = child_environment({"EXTRA": "1"})
    shown = subprocess.run([sys.executable, "-c", "import os, json; print(json.dumps(dict(os.environ)))"],
                           env=env, capture_output=True, text=True, check=True).stdout  # fmt: skip
    seen = json.loads(shown)
    assert not set(SECRET_ENV) & set(seen)
    assert "secret" not in shown.lower()
    assert seen["MLX_RANK"] == "3" and seen["PIPESERVE_HOME"] == "/srv/pipeserve"
    assert seen["PATH"] == os.environ["PATH"] and seen["EXTRA"] == "1"


def test_a_nodes_ranks_get_neither_the_token_nor_the_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeserve.cluster.node import Assignment

    for name, value in SECRET_ENV.items():
        monkeypatch.setenv(name, value)
    agent = NodeAgent("cluster-secret-0123456789", "default", None, tmp_path)
    assignment = Assignment.model_construct(rank=2)
    env = agent._rank_env(assignment)
    assert not set(SECRET_ENV) & set(env) and env["MLX_RANK"] == "2"
