"""`server.memory_budget`: bytes, a size ("8GiB", "512MB"), or a share ("60%") of memory."""

from __future__ import annotations

import os

from pydantic import ByteSize, TypeAdapter, ValidationError

_SIZES = TypeAdapter(ByteSize)


def parse_budget(value: int | str) -> tuple[int | None, float | None]:
    """(bytes, None) or (None, share in (0, 1]); ValueError for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError("memory_budget must not be negative")
        return value, None
    text = str(value).strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1]) / 100
        except ValueError:
            share = -1.0
        if not 0 < share <= 1:
            raise ValueError(f"memory_budget {value!r}: a share is between 0% and 100%, e.g. '60%'")
        return None, share
    try:
        return int(_SIZES.validate_python(text)), None
    except ValidationError:
        raise ValueError(
            f"memory_budget {value!r}: use bytes (8000000000), a size ('8GiB', '512MB') or a"
            " share of memory ('60%')"
        ) from None


def parse_size(value: int | str) -> int:
    """Bytes from an int or a size such as '8GiB' (no shares); ValueError otherwise."""
    size, share = parse_budget(value)
    if size is None or share is not None:
        raise ValueError(f"{value!r}: give bytes or a size such as '8GiB', not a share")
    return size


def total_ram() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def device_memory() -> tuple[int, str]:
    """Total memory models live in: the GPU's where MLX has one (call in a worker: this
    asks MLX), else the machine's RAM."""
    import mlx.core as mx

    if mx.default_device() == mx.gpu:  # Metal or CUDA: the budget is the GPU's memory
        size = mx.device_info().get("memory_size")
        if isinstance(size, int) and size > 0:
            return size, "GPU memory"
    return total_ram(), "RAM"


def budget_bytes(value: int | str | None, workers: int = 1) -> int | None:
    """The budget of one worker process in bytes (each worker holds its own models)."""
    if value is None:
        return None
    size, share = parse_budget(value)
    if share is not None:
        size = int(device_memory()[0] * share)
    return int(size or 0) // max(1, workers)
