"""Giving freed memory back to the system after a load, a warm-up or an unload.

Loading leaves garbage behind that nothing reuses soon: mlx-lm's and the converter's
temporaries, the tokenizer's JSON, the warm-up's batch-of-8 KV buffers. MLX keeps up
to 32 MB of freed buffers in its own cache (the CPU allocator's default limit), and
glibc keeps every freed block in the arena of the thread that freed it: on the CPU,
SmolLM2-135M Q4_1 held ~155 MB more RSS after the engine started than after the same
start plus `release_free_memory()` (docs/cpu-kernels.md, "Memory"); the GLM demo model's
RSS grew ~40 MB per load/unload cycle without it, flat with it.
"""

from __future__ import annotations

import ctypes
import gc


def release_free_memory() -> None:
    """Collect cycles, empty MLX's buffer cache and trim every malloc arena (glibc's
    `malloc_trim`, which also returns free pages inside the arenas; absent on macOS).

    Not for the decode loop: it costs tens of milliseconds, and memory given back is
    paid for again in page faults when it is needed.
    """
    gc.collect()
    try:
        import mlx.core as mx
    except ImportError:  # a replay-only installation
        pass
    else:
        mx.clear_cache()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
