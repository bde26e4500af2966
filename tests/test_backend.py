"""The MLX backend is an install choice: one backend per environment, named in the log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipeserve import backend

REPO = Path(__file__).resolve().parents[1]


def fake_distribution(site: Path, name: str, version: str = "0.32.4") -> Path:
    """An installed distribution's metadata (what pip writes), without its files."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return site


def serve_with(site: Path, home: Path) -> tuple[int, str]:
    """Run `pipeserve serve` with `site` on the path; (exit code, stderr)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(REPO / "src")]),
        "PIPESERVE_HOME": str(home),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeserve.cli", "serve", "--config", "configs/default.yaml"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # it started serving instead of refusing
        _, stderr = proc.communicate()
    return proc.returncode, stderr


def test_this_environment_has_exactly_one_backend() -> None:
    found = backend.installed_backends()
    assert len(found) <= 1, found
    assert backend.install_problem() is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="backend wheels are Linux-only")
def test_serve_refuses_two_backends_that_share_libmlx(tmp_path: Path) -> None:
    installed = next(iter(backend.installed_backends()), "mlx-cpu")
    other = "mlx-cuda-13" if installed == "mlx-cpu" else "mlx-cpu"
    code, stderr = serve_with(fake_distribution(tmp_path / "site", other), tmp_path / "home")
    assert code == 1, stderr[-2000:]
    assert "two MLX backends are installed" in stderr
    assert other in stderr and "libmlx.so" in stderr
    assert not (tmp_path / "home").exists(), "nothing may be built before the refusal"


def test_device_is_described() -> None:
    import mlx.core as mx

    described = backend.describe_device()
    kind = "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"
    assert described.split(" ")[0] == kind, described


def test_kernel_cache_only_for_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(backend.KERNEL_CACHE_ENV, raising=False)
    folder = backend.keep_kernel_cache(tmp_path)
    if "cuda" in backend.installed_backends().values():
        assert folder == tmp_path / "mlx-kernels" and folder.is_dir()
        assert os.environ[backend.KERNEL_CACHE_ENV] == str(folder)
    else:
        assert folder is None and backend.KERNEL_CACHE_ENV not in os.environ
