"""Offline demo models: tiny random-weight mlx-lm models with real tokenizers.

`ensure_demo_model("qwen3")` returns a directory that `mlx_lm.load` loads, building it
first if needed (deterministic: fixed seed; no network). Builds happen in a temporary
directory that is renamed into place, so concurrent builders never see half a model.
Layout under the pipeserve home (PIPESERVE_HOME, default ~/.cache/pipeserve):

    demo/<family>-v<N>/   config.json, model.safetensors, tokenizer.json, ...
    cache/bpe-<table>.json  vocab + merges derived once per quicktok rank table
    tiktoken/o200k_base.tiktoken  for openai-harmony (TIKTOKEN_ENCODINGS_BASE)
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from importlib import resources
from pathlib import Path
from typing import Any

from pipeserve.engine.weights.demo.families import FAMILIES, DemoFamily
from pipeserve.engine.weights.demo.vocab import build_tokenizer, tiktoken_file, write_atomic
from pipeserve.engine.weights.folders import build_folder_once
from pipeserve.settings import pipeserve_home

# qwen3, gpt-oss, glm, kimi, then the tool-call families
DEMO_FAMILIES: tuple[str, ...] = tuple(FAMILIES)
DEMO_VERSION = 3  # bump when the builder's output changes; old builds are ignored
DEMO_PREFIX = "demo:"
WEIGHT_SCALE = 4.0  # MLX's default init makes tiny models repeat one token
_INIT_LOCK = threading.Lock()  # mx.random.seed is process-global: one weight init at a time


def demo_source(source: str) -> str | None:
    """The family of a `demo:<family>` model source, None for any other source."""
    if not source.startswith(DEMO_PREFIX):
        return None
    family = source[len(DEMO_PREFIX) :].strip()
    if family not in FAMILIES:
        raise ValueError(
            f"unknown demo model {source!r}; choose one of "
            + ", ".join(DEMO_PREFIX + f for f in DEMO_FAMILIES)
        )
    return family


def demo_model_dir(family: str, home: Path | None = None) -> Path:
    """Where the demo model of `family` lives (built or not)."""
    return (home or pipeserve_home()) / "demo" / f"{family}-v{DEMO_VERSION}"


def ensure_demo_model(family: str, home: Path | None = None) -> Path:
    """The demo model directory of `family`, built first when missing."""
    spec = _family(family)
    home = home or pipeserve_home()
    target = demo_model_dir(family, home)
    if (target / "config.json").exists():
        return target
    build_folder_once(
        target, f".{family}-build-", lambda tmp: write_demo_model(spec, tmp, home / "cache")
    )
    _remove_stale(family, target.parent)
    return target


def _remove_stale(family: str, folder: Path) -> None:
    """Drop older builder versions and build folders abandoned (crashed) over an hour ago."""
    current = f"{family}-v{DEMO_VERSION}"
    for path in folder.glob(f"{family}-v*"):
        if path.name != current and path.name[len(family) + 2 :].isdigit():
            shutil.rmtree(path, ignore_errors=True)
    for path in folder.glob(f".{family}-build-*"):
        if time.time() - path.stat().st_mtime > 3600:
            shutil.rmtree(path, ignore_errors=True)


def build_demo_models(out_dir: Path | None = None, families: list[str] | None = None) -> list[Path]:
    """Build (or find) the demo models; `out_dir` is a pipeserve home (default: env)."""
    home = out_dir or pipeserve_home()
    return [ensure_demo_model(f, home) for f in (families or list(DEMO_FAMILIES))]


def ensure_tiktoken_base(home: Path | None = None, set_env: bool = True) -> Path:
    """Write o200k_base.tiktoken for openai-harmony and point TIKTOKEN_ENCODINGS_BASE at it.

    openai-harmony otherwise downloads the file; ours is byte-identical (same sha256).
    An already set TIKTOKEN_ENCODINGS_BASE is left alone.
    """
    folder = (home or pipeserve_home()) / "tiktoken"
    path = folder / "o200k_base.tiktoken"
    if not path.exists():
        write_atomic(path, tiktoken_file("o200k"))
    if set_env:
        os.environ.setdefault("TIKTOKEN_ENCODINGS_BASE", str(folder))
    return folder


def chat_template(name: str) -> str:
    """The text of a packaged chat template (engine/weights/demo/templates/<name>)."""
    return (
        resources.files("pipeserve.engine.weights.demo")
        .joinpath("templates", name)
        .read_text("utf-8")
    )


def _family(family: str) -> DemoFamily:
    try:
        return FAMILIES[family]
    except KeyError:
        raise ValueError(
            f"unknown demo family {family!r}; known: {', '.join(DEMO_FAMILIES)}"
        ) from None


def write_demo_model(spec: DemoFamily, out: Path, cache_dir: Path) -> None:
    """Write tokenizer files, config.json and model.safetensors of `spec` into `out`."""
    specials = spec.specials()
    tokenizer = build_tokenizer(spec.vocab, specials, cache_dir)
    tokenizer.save(str(out / "tokenizer.json"))
    eos_ids = [specials[t] for t in spec.eos]
    config = {**spec.config, "vocab_size": tokenizer.get_vocab_size(), "eos_token_id": eos_ids}
    if spec.bos is not None:
        config["bos_token_id"] = specials[spec.bos]
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {"eos_token_id": eos_ids, "do_sample": True})
    _write_json(out / "tokenizer_config.json", _tokenizer_config(spec, specials))
    _write_json(out / "special_tokens_map.json", _special_tokens_map(spec))
    _write_weights(config, spec.seed, out / "model.safetensors")


def _tokenizer_config(spec: DemoFamily, specials: dict[str, int]) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": spec.config["max_position_embeddings"],
        "bos_token": spec.bos,
        "eos_token": spec.eos[0],
        "pad_token": spec.pad,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": [t for t in specials if not t.startswith("<|reserved")],
        "chat_template": chat_template(spec.template),
        **spec.extra_tokenizer_config,
    }


def _special_tokens_map(spec: DemoFamily) -> dict[str, Any]:
    tokens = {"eos_token": spec.eos[0], "pad_token": spec.pad}
    if spec.bos is not None:
        tokens["bos_token"] = spec.bos
    return tokens


def _write_weights(config: dict[str, Any], seed: int, path: Path) -> None:
    """Random float32 weights from mlx-lm's own module init, 2-D+ weights scaled."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    weights: dict[str, mx.array] = {}
    with _INIT_LOCK:
        mx.random.seed(seed)
        model = model_class(args_class.from_dict(config))
        for name, value in tree_flatten(model.parameters()):
            value = value.astype(mx.float32)
            weights[name] = value * WEIGHT_SCALE if value.ndim >= 2 else value
        mx.eval(weights)
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
