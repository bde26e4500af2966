"""Building the native CPU kernels (affine_qmm.cpp) once per MLX version and CPU.

The extension is compiled from source with the system compiler through CMake and
nanobind on first use and cached under `<PIPESERVE_HOME>/cpu-kernels/<key>/`, the key
naming the MLX version, the instruction sets chosen from this CPU's features and a
hash of the sources, so an upgraded MLX, another CPU or changed sources build anew.
Built in a temporary folder and renamed into place: concurrent workers that race keep
the winner's build.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

log = logging.getLogger("pipeserve.engine")

SOURCES = Path(__file__).resolve().parent
SOURCE_FILES = (
    "kernels.h",
    "strided.h",
    "simd512.h",
    "vector_math.h",
    "attention.h",
    "attention.cpp",
    "attention_quantized.h",
    "attention_quantized.cpp",
    "affine_qmm.cpp",
    "prefill_gemm.cpp",
    "prefill_attention.h",
    "prefill_attention.cpp",
    "fused.cpp",
    "fused_step.cpp",
    "fused_layer.cpp",
    "f32_matmul.cpp",
    "cache_rows.cpp",
    "roll_rows.cpp",
    "sampling_filters.cpp",
    "bert_encoder.cpp",
    "donation.h",
    "bindings.cpp",
    "CMakeLists.txt",
)
MODULE = "_pipeserve_cpu"
BUILD_SECONDS = 900  # a shared 2-core machine can take minutes

# Compiler flags per instruction set, chosen by the CPU's /proc/cpuinfo flags; the
# first whose features the CPU has wins (VNNI: the few-row integer path's vpdpwssd).
AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c", "bmi2")
AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c", "-mbmi2")
ISA_FLAGS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    # VBMI: the 5-bit unpack of the integer path in three instructions (affine_qmm.cpp)
    (
        "avx512vnni-vbmi",
        (*AVX512, "avx512_vnni", "avx512vbmi"),
        (*AVX512_FLAGS, "-mavx512vnni", "-mavx512vbmi"),
    ),  # fmt: skip
    ("avx512vnni", (*AVX512, "avx512_vnni"), (*AVX512_FLAGS, "-mavx512vnni")),
    ("avx512", AVX512, AVX512_FLAGS),
    ("avx2", ("avx2", "fma", "f16c", "bmi2"), ("-mavx2", "-mfma", "-mf16c", "-mbmi2")),
)


class BuildError(RuntimeError):
    """The extension could not be built here (no toolchain, a compile error)."""


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def instruction_set(flags: set[str]) -> tuple[str, tuple[str, ...]]:
    """(name, compiler flags) of the widest instruction set this CPU has."""
    for name, needed, compiler_flags in ISA_FLAGS:
        if set(needed) <= flags:
            return name, compiler_flags
    return "scalar", ()


def missing_tools() -> list[str]:
    return [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]


def build_key(isa: str) -> str:
    import mlx.core as mx

    digest = hashlib.sha256()
    for name in SOURCE_FILES:
        digest.update((SOURCES / name).read_bytes())
    tag = f"{sys.implementation.cache_tag}"
    return f"mlx{mx.__version__}-{isa}-{tag}-{digest.hexdigest()[:12]}"


def _target(home: Path) -> tuple[Path, tuple[str, ...]]:
    isa, flags = instruction_set(cpu_flags())
    return home / "cpu-kernels" / build_key(isa), flags


def cached_module(home: Path) -> Path | None:
    """The compiled extension for this MLX and CPU if it is built already."""
    existing = sorted(_target(home)[0].glob(f"{MODULE}*.so"))
    return existing[0] if existing else None


def built_module(home: Path) -> Path:
    """The compiled extension for this MLX and CPU, building it first when missing."""
    cached = cached_module(home)
    if cached is not None:
        return cached
    target, flags = _target(home)
    isa = instruction_set(cpu_flags())[0]
    missing = missing_tools()
    if missing:
        raise BuildError(f"no {' or '.join(missing)} on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-build-"))
    try:
        log.info("building pipeserve's CPU kernels (%s) into %s", isa, target)
        _cmake(tmp / "build", flags)
        (tmp / "out").mkdir()
        for so in (tmp / "build").glob(f"{MODULE}*.so"):
            shutil.copy2(so, tmp / "out" / so.name)
        try:
            os.rename(tmp / "out", target)
        except OSError:
            if not any(target.glob(f"{MODULE}*.so")):  # not a lost race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sorted(target.glob(f"{MODULE}*.so"))[0]


def _cmake(build_dir: Path, flags: tuple[str, ...]) -> None:
    configure = [
        "cmake", "-S", str(SOURCES), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
        f"-DPython_EXECUTABLE={sys.executable}", f"-DPIPESERVE_SIMD_FLAGS={' '.join(flags)}",
    ]  # fmt: skip
    jobs = str(max(1, len(os.sched_getaffinity(0))))
    for command in (configure, ["cmake", "--build", str(build_dir), "-j", jobs]):
        code, output = _run(command)
        if code != 0:
            tail = output.strip().splitlines()[-15:]
            raise BuildError(f"{' '.join(command[:2])} failed:\n" + "\n".join(tail))


def _run(command: list[str]) -> tuple[int, str]:
    """(exit code, output) of a command. Under gevent (a server's engine thread builds on
    first use) gevent's subprocess cannot wait off the main thread ("child watchers are
    only available on the default loop"): there the OS's own spawn and waitpid run it."""
    if "gevent.monkey" not in sys.modules:
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_SECONDS)
        return done.returncode, done.stdout + done.stderr
    from pipeserve.engine.sharding.procs import exit_codes
    from pipeserve.gevent_support import unpatched_os

    with tempfile.TemporaryFile() as out:
        dup2 = os.POSIX_SPAWN_DUP2
        actions = [(dup2, out.fileno(), 1), (dup2, out.fileno(), 2)]
        path = shutil.which(command[0]) or command[0]
        pid = unpatched_os("posix_spawn")(path, command, dict(os.environ), file_actions=actions)
        (code,) = exit_codes([pid], BUILD_SECONDS)
        out.seek(0)
        return (-1 if code is None else code), out.read().decode(errors="replace")


def import_module(path: Path) -> ModuleType:
    import mlx.core  # noqa: F401  (registers the array type the extension shares)

    spec = importlib.util.spec_from_file_location(MODULE, path)
    if spec is None or spec.loader is None:
        raise BuildError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
