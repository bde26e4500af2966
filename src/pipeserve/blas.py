"""OpenBLAS for MLX on Linux CPUs, from PyPI alone.

The `mlx[cpu]` wheel links a single-threaded reference BLAS (~5 GFLOP/s fp32 matmul
here). The `cmeel-openblas` wheel ships an OpenBLAS with the same cblas symbols; with
it preloaded MLX's matmuls run ~60x faster, which is what makes batching pay off.
OpenBLAS needs libgfortran.so.5 and libquadmath.so.0, which `mlx_cpu.libs/` already
ships under hashed names: we expose them under the names the loader asks for in a
private folder of symlinks. LD_PRELOAD only works from process start, so `serve`
re-executes itself once with the environment set (see `reexec_with_openblas`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

MARKER = "PIPESERVE_BLAS_APPLIED"
WANTED_LIBS = {"libgfortran.so.5": "libgfortran", "libquadmath.so.0": "libquadmath"}


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def find_openblas() -> Path | None:
    candidate = site_packages() / "cmeel.prefix" / "lib" / "libopenblas.so.0"
    return candidate if candidate.exists() else None


def runtime_lib_dir(home: Path) -> Path | None:
    """A folder of symlinks named as OpenBLAS's loader expects, into mlx_cpu.libs."""
    shipped = site_packages() / "mlx_cpu.libs"
    if not shipped.is_dir():
        return None
    target_dir = home / "blas-libs"
    target_dir.mkdir(parents=True, exist_ok=True)
    for soname, prefix in WANTED_LIBS.items():
        matches = sorted(shipped.glob(f"{prefix}-*.so*"))
        if not matches:
            return None
        link = target_dir / soname
        if not link.exists():
            tmp = target_dir / f".{soname}.{os.getpid()}"
            tmp.symlink_to(matches[0])
            tmp.replace(link)
    return target_dir


def openblas_environment(home: Path) -> dict[str, str] | None:
    """Environment additions that preload OpenBLAS, or None when unavailable."""
    if not sys.platform.startswith("linux"):
        return None
    openblas = find_openblas()
    libs = runtime_lib_dir(home) if openblas else None
    if openblas is None or libs is None:
        return None
    preload = " ".join(p for p in (str(openblas), os.environ.get("LD_PRELOAD", "")) if p)
    # mlx_cpu.libs too: the shipped libgfortran asks for libquadmath by its hashed name.
    shipped = site_packages() / "mlx_cpu.libs"
    library_path = ":".join(
        p for p in (str(libs), str(shipped), os.environ.get("LD_LIBRARY_PATH", "")) if p
    )
    return {"LD_PRELOAD": preload, "LD_LIBRARY_PATH": library_path, MARKER: "1"}


PROBE = (
    "import mlx.core as mx\n"
    "a = mx.ones((192, 192)); b = mx.full((192, 192), 2.0)\n"
    "assert float((a @ b)[0, 0]) == 384.0\n"
    "from pipeserve.blas import loaded_blas; print(loaded_blas())\n"
)


def probe(extra: dict[str, str]) -> bool:
    """Run a matmul in a child with the preload: the build may not suit this CPU (SIGILL)."""
    env = {**os.environ, **extra}
    try:
        result = subprocess.run(
            [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0 and result.stdout.strip() == "openblas"


def reexec_with_openblas(mode: str, home: Path) -> str | None:
    """Restart this very command with OpenBLAS preloaded (once; never loops).

    Returns a reason when OpenBLAS is not used; does not return when it re-executes."""
    if mode == "off":
        return "opted out (PIPESERVE_BLAS=off)"
    if os.environ.get(MARKER) or loaded_blas() == "openblas":
        return None
    extra = openblas_environment(home)
    if extra is None:
        return "cmeel-openblas is not installed for this platform"
    if not probe(extra):
        return "the installed OpenBLAS failed its start-up check on this CPU"
    env = {**os.environ, **extra}
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    return None  # not reached


def loaded_blas() -> str:
    """Which BLAS this process has mapped: 'openblas', 'reference' or 'unknown'."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    if "libopenblas" in maps:
        return "openblas"
    if "libblas" in maps:
        return "reference"
    return "unknown"
