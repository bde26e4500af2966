"""Converted weights written as they are produced, in safetensors shards of about
SHARD_BYTES, so a conversion holds at most one shard (plus the tensor being decoded) in
memory. One shard is `model.safetensors`; more are `model-00001-of-00003.safetensors` ...
with a `model.safetensors.index.json` (mlx-lm loads every `model*.safetensors`)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SHARD_BYTES = 1 << 30


def write_shards(out: Path, weights: Iterable[tuple[str, Any]]) -> None:
    import mlx.core as mx

    shards: list[list[str]] = []  # the names in each written shard
    pending: dict[str, Any] = {}
    size = 0

    def flush() -> None:
        nonlocal pending, size
        temporary = out / f".shard-{len(shards)}.safetensors"
        mx.save_safetensors(str(temporary), pending, metadata={"format": "mlx"})
        shards.append(list(pending))
        pending, size = {}, 0

    for name, value in weights:
        pending[name] = value
        size += value.nbytes
        if size >= SHARD_BYTES:
            flush()
    if pending or not shards:
        flush()
    _name_shards(out, shards)


def _name_shards(out: Path, shards: list[list[str]]) -> None:
    count = len(shards)
    files = (
        ["model.safetensors"]
        if count == 1
        else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    )
    for i, file in enumerate(files):
        os.rename(out / f".shard-{i}.safetensors", out / file)
    if count > 1:
        weight_map = {name: files[i] for i, names in enumerate(shards) for name in names}
        index = {"metadata": {"format": "mlx"}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
