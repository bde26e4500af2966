"""Resolving a model `source` to a folder and loading it with mlx-lm's own loader.

Sources: `demo:<family>` (built offline on first use), a local mlx-lm model folder,
or a Hugging Face repo id (downloaded by mlx-lm's loader, with huggingface_hub's
progress bars; never in tests).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("pipeserve.engine")

DTYPES = ("float32", "float16", "bfloat16")


def resolve_source(source: str) -> Path:
    """The local folder of a model source, building or downloading it if needed."""
    from pipeserve.engine.demo import demo_source, ensure_demo_model

    family = demo_source(source)
    if family is not None:
        return ensure_demo_model(family)
    path = Path(source).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"model folder {path} has no config.json (not an mlx-lm model folder)"
            )
        return path
    if _looks_like_path(source):
        raise FileNotFoundError(f"model folder {source} does not exist")
    return _download(source)


def _looks_like_path(source: str) -> bool:
    return source.startswith((".", "/", "~")) or source.count("/") != 1


def _download(repo: str) -> Path:
    from mlx_lm.utils import _download as mlx_download

    log.info("downloading %s from the Hugging Face Hub (progress below)", repo)
    return Path(mlx_download(repo))


def load_tokenizer(model_dir: Path) -> Any:
    """mlx-lm's TokenizerWrapper (HF tokenizer + streaming detokenizer)."""
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    config = read_config(model_dir)
    return mlx_load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id"))


def load_model(model_dir: Path, dtype: str = "auto", cpu_pretranspose: bool = False) -> Any:
    """The mlx-lm model with its weights evaluated, optionally cast to `dtype` and, on
    the CPU, with float32 dense weights stored transposed (engine/cpu_layout.py).

    Call it on the thread that will run the model (MLX arrays belong to their thread).
    """
    import mlx.core as mx
    from mlx_lm.utils import load_model as mlx_load_model

    from pipeserve.engine import cpu_layout

    model, _ = mlx_load_model(model_dir)
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use auto or one of {', '.join(DTYPES)}")
        model.set_dtype(getattr(mx, dtype))
        mx.eval(model.parameters())
    if cpu_pretranspose and cpu_layout.applies_here():
        started = time.monotonic()
        count = cpu_layout.pretranspose_dense_weights(model)
        log.info("%s: %d float32 weight matrices stored transposed for the CPU BLAS (%.1f s)",
                 model_dir.name, count, time.monotonic() - started)  # fmt: skip
    return model


def read_config(model_dir: Path) -> dict[str, Any]:
    return _read_json(model_dir / "config.json")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _ids(value: Any) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()


def eos_token_ids(tokenizer: Any, model_dir: Path) -> frozenset[int]:
    """The tokenizer's EOS ids plus those of config.json and generation_config.json."""
    ids = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    ids |= _ids(read_config(model_dir).get("eos_token_id"))
    ids |= _ids(_read_json(model_dir / "generation_config.json").get("eos_token_id"))
    return frozenset(ids)


def context_length(model_dir: Path) -> int | None:
    """The model's trained context length from its config, when it says."""
    config = read_config(model_dir)
    for section in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"):
            value = section.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None
