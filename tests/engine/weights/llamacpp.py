"""llama.cpp as the reference: llama-cpp-python in a venv of its own, the same one
benchmarks/cpu_bench.py builds ($PIPESERVE_HOME/bench/llama-cpp-venv, from source with
AVX2/FMA/F16C; ~5 minutes on 2 cores, once).

The `llamacpp` tests run when that venv exists, or build it first when
PIPESERVE_LLAMACPP=build; otherwise they skip, saying so (CI runs them as a job of
their own: `PIPESERVE_LLAMACPP=build python -m pytest -m llamacpp`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

LLAMA_CPP = "llama-cpp-python==0.3.36"  # as benchmarks/cpu_bench.py
LLAMA_CMAKE_ARGS = "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
WORKER = Path(__file__).with_name("llamacpp_worker.py")


def llama_python() -> str:
    """The venv's interpreter; builds it under PIPESERVE_LLAMACPP=build, else skips."""
    from pipeserve.settings import pipeserve_home

    venv = pipeserve_home() / "bench" / "llama-cpp-venv"
    python = venv / "bin" / "python"
    check = [str(python), "-c", "import llama_cpp"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return str(python)
    if os.environ.get("PIPESERVE_LLAMACPP") != "build":
        pytest.skip(f"no llama-cpp-python venv at {venv} (PIPESERVE_LLAMACPP=build builds it)")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "CMAKE_ARGS": LLAMA_CMAKE_ARGS}
    subprocess.run([str(python), "-m", "pip", "install", "-q", LLAMA_CPP], check=True, env=env)
    return str(python)


def run_llama(gguf: Path, prompts: list[str], tokens: int, corpus: list[str],
              work: Path) -> dict[str, Any]:  # fmt: skip
    """llama.cpp's tokens, greedy continuations and logits (llamacpp_worker.py)."""
    job = {"gguf": str(gguf), "prompts": prompts, "tokens": tokens, "corpus": corpus}
    return run_llama_job(job, work)


def run_llama_job(job: dict[str, Any], work: Path) -> dict[str, Any]:
    """One job of llamacpp_worker.py (its `command`: generate, embed, fim) -> its answer."""
    command = job.get("command", "generate")
    spec, out = work / f"llama-{command}-job.json", work / f"llama-{command}-out.json"
    spec.write_text(json.dumps(job))
    result = subprocess.run([llama_python(), str(WORKER), str(spec), str(out)],
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    answer: dict[str, Any] = json.loads(out.read_text())
    return answer
