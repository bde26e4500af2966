"""LoRA adapter folders as mlx-lm's `lora` command writes them: `adapter_config.json`
(fine_tune_type, num_layers, lora_parameters: rank, scale, optional keys) and
`adapters.safetensors` (`<module path>.lora_a` of shape (input dims, rank) and
`<module path>.lora_b` of shape (rank, output dims) per adapted linear).

`read_adapter` checks a folder by itself, reading only the safetensors header (no
tensor is loaded): what `pipeserve validate` reports. `check_against` checks it against
the base model's linears (their dims by path): what a load checks before any weight is
attached, and what validate checks too where the base's files are on disk. Every
problem names the adapter and what is wrong (AdapterError).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapters.safetensors"
LEAVES = ("lora_a", "lora_b")
MAX_HEADER_BYTES = 100 << 20


class AdapterError(ValueError):
    """An adapter that cannot be served: str() names it and says what is wrong."""


@dataclass(frozen=True)
class AdapterFiles:
    """An adapter folder's facts: its rank, scale and the shapes of each adapted module."""

    name: str
    path: Path
    rank: int
    scale: float
    num_layers: int
    keys: tuple[str, ...] | None  # the module names the config targets (None: mlx-lm's default)
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]  # module -> (a shape, b shape)

    @property
    def nbytes(self) -> int:
        """float32 bytes of the low-rank matrices."""
        total = 0
        for a, b in self.shapes.values():
            total += 4 * (_count(a) + _count(b))
        return total


def _count(shape: tuple[int, ...]) -> int:
    size = 1
    for dim in shape:
        size *= dim
    return size


def read_adapter(name: str, path: Path) -> AdapterFiles:
    """The adapter folder's facts, or AdapterError naming what is wrong with it."""
    if not path.is_dir():
        raise AdapterError(f"adapter {name!r}: {path} is not a folder")
    config = _read_config(name, path / CONFIG_FILE)
    rank, scale, num_layers, keys = _lora_parameters(name, config)
    header = safetensors_header(name, path / WEIGHTS_FILE)
    shapes = _pairs(name, header)
    for module, (a, b) in shapes.items():
        if len(a) != 2 or len(b) != 2:
            raise AdapterError(f"adapter {name!r}: {module}: lora_a and lora_b must be matrices")
        if a[1] != rank or b[0] != rank:
            raise AdapterError(
                f"adapter {name!r}: {module}: wrong rank: lora_a {a}, lora_b {b} for rank"
                f" {rank} (adapter_config.json lora_parameters.rank)"
            )
    return AdapterFiles(name, path, rank, scale, num_layers, keys, shapes)


def _read_config(name: str, file: Path) -> dict[str, Any]:
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AdapterError(f"adapter {name!r}: missing {file}") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"adapter {name!r}: {file} is not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r}: {file} is not a JSON object")
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise AdapterError(
            f"adapter {name!r}: fine_tune_type {kind!r} is not served (only lora adapters)"
        )
    return config


def _lora_parameters(
    name: str, config: dict[str, Any]
) -> tuple[int, float, int, tuple[str, ...] | None]:
    params = config.get("lora_parameters")
    if not isinstance(params, dict):
        raise AdapterError(f"adapter {name!r}: adapter_config.json has no lora_parameters")
    rank, scale = params.get("rank"), params.get("scale")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"adapter {name!r}: lora_parameters.rank must be a positive integer")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise AdapterError(f"adapter {name!r}: lora_parameters.scale must be a number")
    num_layers = config.get("num_layers")
    if not isinstance(num_layers, int) or isinstance(num_layers, bool):
        raise AdapterError(f"adapter {name!r}: adapter_config.json has no integer num_layers")
    keys = params.get("keys")
    if keys is not None and not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        raise AdapterError(f"adapter {name!r}: lora_parameters.keys must be a list of names")
    return rank, float(scale), num_layers, None if keys is None else tuple(keys)


def safetensors_header(name: str, file: Path) -> dict[str, Any]:
    """The tensors' names and shapes (safetensors: an 8-byte length, then JSON)."""
    try:
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if not 0 < length <= MAX_HEADER_BYTES:
                raise ValueError("bad header length")
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise AdapterError(f"adapter {name!r}: missing {file}") from None
    except (OSError, ValueError, struct.error) as exc:
        raise AdapterError(f"adapter {name!r}: {file} is not a safetensors file ({exc})") from None
    if not isinstance(header, dict):
        raise AdapterError(f"adapter {name!r}: {file} is not a safetensors file")
    return {k: v for k, v in header.items() if k != "__metadata__"}


def _pairs(name: str, header: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    found: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, info in header.items():
        module, _, leaf = key.rpartition(".")
        if leaf not in LEAVES or not module:
            raise AdapterError(
                f"adapter {name!r}: tensor {key!r} is not a LoRA matrix (lora_a / lora_b);"
                " only lora adapters are served"
            )
        shape = info.get("shape") if isinstance(info, dict) else None
        if not isinstance(shape, list):
            raise AdapterError(f"adapter {name!r}: tensor {key!r} has no shape")
        found.setdefault(module, {})[leaf] = tuple(int(d) for d in shape)
    if not found:
        raise AdapterError(f"adapter {name!r}: adapters.safetensors holds no LoRA matrices")
    for module, leaves in found.items():
        missing = [leaf for leaf in LEAVES if leaf not in leaves]
        if missing:
            raise AdapterError(f"adapter {name!r}: missing key {module}.{missing[0]}")
    return {m: (leaves["lora_a"], leaves["lora_b"]) for m, leaves in sorted(found.items())}


# A base model's linears: module path -> (input dims, output dims), or None for a module
# of a kind that cannot take an adapter here (an embedding, an expert layer).
Linears = dict[str, tuple[int, int] | None]


def check_against(files: AdapterFiles, linears: Linears, layers: int, prefix: str) -> None:
    """AdapterError when the adapter does not fit the base: an unknown or unsupported
    target module, shapes that do not match its dims, or a module the config targets
    (the last num_layers layers' `keys`) without its matrices. `prefix`: the path of the
    model's layer list (`model.layers`)."""
    name = files.name
    for module, (a, b) in files.shapes.items():
        if module not in linears:
            raise AdapterError(f"adapter {name!r}: unknown target module {module!r} in the base")
        dims = linears[module]
        if dims is None:
            raise AdapterError(
                f"adapter {name!r}: target module {module!r} is not a linear layer"
                " (only Linear / QuantizedLinear targets are served)"
            )
        if (a[0], b[1]) != dims:
            raise AdapterError(
                f"adapter {name!r}: {module}: wrong shapes: lora_a {a}, lora_b {b} for a"
                f" linear of {dims[0]} inputs and {dims[1]} outputs"
            )
    for module in expected_targets(files, linears, layers, prefix):
        if module not in files.shapes:
            raise AdapterError(f"adapter {name!r}: missing keys {module}.lora_a, .lora_b")


def expected_targets(files: AdapterFiles, linears: Linears, layers: int, prefix: str) -> list[str]:
    """The linears mlx-lm's loader adapts (linear_to_lora_layers): `keys` (every linear by
    default) in the last num_layers layers."""
    if files.num_layers > layers:
        raise AdapterError(
            f"adapter {files.name!r}: num_layers {files.num_layers} is above the base's"
            f" {layers} layers"
        )
    first = layers - files.num_layers if files.num_layers > 0 else 0  # mlx-lm: [-n:]
    wanted = []
    for index in range(first, layers):
        head = f"{prefix}.{index}."
        for module, dims in linears.items():
            if not module.startswith(head) or dims is None:
                continue
            if files.keys is None or module[len(head) :] in files.keys:
                wanted.append(module)
    if files.keys is not None:
        for key in files.keys:
            if not any(m.startswith(f"{prefix}.") and m.endswith("." + key) for m in linears):
                raise AdapterError(
                    f"adapter {files.name!r}: lora_parameters.keys names {key!r}, which no"
                    " layer of the base has"
                )
    return wanted
