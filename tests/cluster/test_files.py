"""Model files from the serving machine: served to token holders only, checked by sha256
on arrival (a file that changed since it was listed is refused), reused when present.
Real sockets on 127.0.0.1; no MLX."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeserve.cluster.files import FileServer, fetch_model, manifest
from pipeserve.cluster.wire import NodeRefused, open_download
from pipeserve.engine.sharding.load import PARTIAL_MARKER

TOKEN = "files-test-token-0123456789"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, FileServer]]:
    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "qwen3"}')
    (source / "tokenizer.json").write_bytes(b"x" * 300_000)
    (source / ".hidden").write_text("never listed")
    server = FileServer("127.0.0.1", TOKEN, source, manifest(source))
    yield source, server
    server.close()


def test_a_node_fetches_checks_and_then_reuses_the_files(
    served: tuple[Path, FileServer], tmp_path: Path
) -> None:
    source, server = served
    files = manifest(source)
    assert [f.name for f in files] == ["config.json", "tokenizer.json"]
    target = tmp_path / "node"
    first = fetch_model(target, files, None, ("127.0.0.1", server.port), TOKEN)
    assert first.fetched == ["config.json", "tokenizer.json"] and first.reused == []
    assert (target / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    assert not (target / PARTIAL_MARKER).exists()
    again = fetch_model(target, files, None, ("127.0.0.1", server.port), TOKEN)
    assert again.fetched == [] and again.reused == ["config.json", "tokenizer.json"]


def test_a_file_that_does_not_match_its_sha256_is_refused(
    served: tuple[Path, FileServer], tmp_path: Path
) -> None:
    source, server = served
    files = manifest(source)
    (source / "tokenizer.json").write_bytes(b"y" * 300_000)  # changed after it was listed
    with pytest.raises(ValueError, match="tokenizer.json .* failed its sha256 check"):
        fetch_model(tmp_path / "node", files, None, ("127.0.0.1", server.port), TOKEN)
    assert not (tmp_path / "node" / "tokenizer.json").exists()


def test_files_need_the_token_and_only_listed_files_are_served(
    served: tuple[Path, FileServer],
) -> None:
    _, server = served
    with pytest.raises(NodeRefused, match="401"):
        open_download("127.0.0.1", server.port, "/files/config.json", "wrong-token-0123456789")
    for path in ("/files/.hidden", "/files/../model/config.json", "/etc/passwd"):
        with pytest.raises(NodeRefused, match="404"):
            open_download("127.0.0.1", server.port, path, TOKEN)
