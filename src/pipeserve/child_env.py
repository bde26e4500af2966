"""The environment pipeserve's own child processes get: an allow-list, never its secrets.

Local ranks of a sharded model, the ranks a node starts, the ssh clients that start remote
ranks, and the LAN discovery child run pipeserve's code or the system's tools, which need
the paths, locale, Python, MLX / BLAS / GPU settings and pipeserve's own settings. None
of them needs the cluster token, the API keys or the database password (a rank gets its
group's secret on its stdin), so those never reach their environment, where a core dump,
a `/proc/PID/environ` reader with the same uid, or a crash report could show them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# Never passed on, whatever the allow-list says.
SECRETS = frozenset(
    {"PIPESERVE_CLUSTER_TOKEN", "PIPESERVE_API_KEY", "PIPESERVE_API_KEYS", "PGPASSWORD"}
)
NAMES = frozenset(
    {"PATH", "HOME", "USER", "LOGNAME", "SHELL", "TERM", "LANG", "LANGUAGE", "TZ", "TMPDIR",
     "TMP", "TEMP", "VIRTUAL_ENV", "LD_PRELOAD", "LD_LIBRARY_PATH", "SSH_AUTH_SOCK",
     "HOSTNAME", "SYSTEMROOT"}
)  # fmt: skip
PREFIXES = ("LC_", "PYTHON", "MLX_", "OPENBLAS_", "OMP_", "MKL_", "GOTO", "CUDA", "NVIDIA_",
            "NCCL_", "XDG_", "PIPESERVE_")  # fmt: skip


def child_environment(
    extra: Mapping[str, str] | None = None, source: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The allow-listed part of `source` (this process's environment), plus `extra`."""
    env = os.environ if source is None else source
    kept = {k: v for k, v in env.items()
            if (k in NAMES or k.startswith(PREFIXES)) and k not in SECRETS}  # fmt: skip
    return {**kept, **(extra or {})}


__all__ = ["SECRETS", "child_environment"]
