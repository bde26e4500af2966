"""Which MLX backend is installed (an install choice) and where a model runs.

On Linux MLX's backend is a separate wheel: `mlx-cpu` (pipeserve[cpu], the default in
the README) or `mlx-cuda-13` (pipeserve[cuda], NVIDIA GPUs). Both install the same file,
`mlx/lib/libmlx.so`, so with both present one silently overwrites the other (and
uninstalling one deletes the other's library): the server refuses to start then. On
macOS `mlx` brings its Metal backend itself.

Read from installed package metadata, without importing MLX: `serve` decides here,
before MLX is loaded, whether to preload OpenBLAS (the CPU backend only).
"""

from __future__ import annotations

import os
import sys
from importlib import metadata
from pathlib import Path

# Backend distributions and what they run on.
BACKENDS = {"mlx-cpu": "cpu", "mlx-cuda-12": "cuda", "mlx-cuda-13": "cuda", "mlx-metal": "metal"}
KERNEL_CACHE_ENV = "MLX_PTX_CACHE_DIR"  # where MLX's CUDA backend keeps JIT-compiled kernels


def installed_backends() -> dict[str, str]:
    """Installed backend distributions -> the kind of device each one drives."""
    found = {}
    for dist, kind in BACKENDS.items():
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        found[dist] = kind
    return found


def install_problem() -> str | None:
    """Why MLX cannot run as installed, in words a user can act on; None when it can."""
    found = installed_backends()
    if len(found) > 1:
        names = " and ".join(sorted(found))
        return (
            f"two MLX backends are installed ({names}); they overwrite each other's "
            "mlx/lib/libmlx.so. Uninstall both, then install one: "
            "pip install 'pipeserve[cpu]' (CPU) or 'pipeserve[cuda]' (NVIDIA GPU, CUDA 13)"
        )
    if not found and sys.platform.startswith("linux"):
        return (
            "no MLX backend is installed; install pipeserve[cpu] (any CPU) or "
            "pipeserve[cuda] (NVIDIA GPU, CUDA 13)"
        )
    return None


def cpu_backend() -> bool:
    """True when MLX can only run on the CPU here (the Linux CPU wheel)."""
    return set(installed_backends().values()) == {"cpu"}


def gpu_backend() -> bool:
    return bool({"cuda", "metal"} & set(installed_backends().values()))


def keep_kernel_cache(home: Path) -> Path | None:
    """Point MLX's CUDA kernel cache into the pipeserve home (unless the user set one):
    JIT-compiled kernels then survive restarts and are shared by all workers."""
    if "cuda" not in installed_backends().values():
        return None
    folder = Path(os.environ.setdefault(KERNEL_CACHE_ENV, str(home / "mlx-kernels")))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def describe_device() -> str:
    """The device MLX runs on in this process, e.g. 'gpu (NVIDIA H200)' or 'cpu (Intel Xeon)'."""
    import mlx.core as mx

    kind = "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"
    try:
        info = mx.device_info()
    except (AttributeError, RuntimeError):  # older MLX, or a backend without device info
        info = {}
    name = info.get("device_name") or info.get("architecture") or ""
    return f"{kind} ({name})" if name else kind
