"""Random-weight Qwen3-architecture models for benchmarks, built offline.

The tokenizer files (real Qwen vocabulary) come from pipeserve's qwen3 demo model;
config.json and the weights are written here for the requested shape, in float32.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from pipeserve.engine.demo import ensure_demo_model

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
