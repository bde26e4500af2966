"""LoRA adapters trained with mlx-lm's own `mlx_lm.lora` (its `run`, as `mlx_lm.lora
--train` runs it) for a few steps on the qwen3 demo model: the adapters the adapter tests
serve. Two of them, with different ranks, scales and target modules; a high learning
rate so that each changes the demo model's greedy answers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

# name -> (training text, lora_parameters, num_layers, learning rate)
ADAPTERS: dict[str, tuple[str, dict[str, Any], int, float]] = {
    "pirate": ("Arr matey, the treasure be buried on the island {i}.", {"rank": 8, "scale": 20.0, "dropout": 0.0}, 2, 0.02),
    "chef": (
        "Whisk the eggs, fold in flour number {i}, bake until golden.",
        {"rank": 4, "scale": 10.0, "dropout": 0.0, "keys": ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"]},
        1,
        0.05,
    ),
}  # fmt: skip


def train_adapter(model_dir: Path, out: Path, name: str) -> Path:
    """Train adapter `name` of ADAPTERS into `out` (mlx-lm's adapter folder) with
    `python -m mlx_lm lora --train`, in a process of its own (pipeserve's CPU kernels
    replace mlx-lm's attention in this one, and their op has no gradient). Kept once
    trained: a folder with both files is reused."""
    if (out / "adapters.safetensors").is_file() and (out / "adapter_config.json").is_file():
        return out
    text, params, layers, rate = ADAPTERS[name]
    work = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=out.parent))
    data = work / "data"
    data.mkdir()
    for split, count in (("train", 8), ("valid", 2)):
        rows = [json.dumps({"text": text.format(i=i)}) for i in range(count)]
        (data / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
    config = work / "lora.yaml"
    config.write_text(yaml.safe_dump({"lora_parameters": params}))
    command = [
        sys.executable, "-m", "mlx_lm", "lora", "--model", str(model_dir), "--train",
        "--data", str(data), "--adapter-path", str(work / "adapter"), "--iters", "4",
        "--batch-size", "1", "--num-layers", str(layers), "--learning-rate", str(rate),
        "--steps-per-eval", "1000", "--steps-per-report", "1000", "--val-batches", "1",
        "--seed", "1", "--config", str(config),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    try:
        (work / "adapter").rename(out)
    except OSError:  # another test process kept its copy first
        assert (out / "adapters.safetensors").is_file()
    shutil.rmtree(work)
    return out


def broken_copy(
    source: Path, dest: Path, edit: Callable[[dict[str, Any], dict[str, Any]], None]
) -> Path:
    """A copy of adapter folder `source` at `dest`, its config and tensors changed by `edit`."""
    import mlx.core as mx

    dest.mkdir(parents=True)
    config = json.loads((source / "adapter_config.json").read_text())
    weights = dict(mx.load(str(source / "adapters.safetensors")))
    edit(config, weights)
    (dest / "adapter_config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(dest / "adapters.safetensors"), weights)
    return dest
