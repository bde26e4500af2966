"""OpenBLAS preload from PyPI alone: the environment loads it and MLX computes right."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeserve import backend, blas

PROBE = """
import mlx.core as mx, numpy as np
from pipeserve.blas import loaded_blas
a = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
b = np.random.default_rng(1).standard_normal((256, 256)).astype(np.float32)
out = np.array(mx.matmul(mx.array(a), mx.array(b)))
assert np.allclose(out, a @ b, atol=1e-3), "wrong matmul"
print(loaded_blas())
"""

pytestmark = pytest.mark.skipif(
    not backend.cpu_backend(), reason="OpenBLAS is preloaded only for MLX's CPU backend"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenBLAS preload is Linux-only")
def test_openblas_environment_loads_and_computes(tmp_path: Path) -> None:
    extra = blas.openblas_environment(tmp_path)
    assert extra is not None, "cmeel-openblas or mlx_cpu.libs missing"
    env = {**os.environ, **extra}
    result = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "openblas"


def test_without_preload_reports_bundled_blas() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.MARKER)}
    result = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() in {"reference", "unknown"}
