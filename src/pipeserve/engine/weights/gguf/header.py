"""A GGUF file's header (metadata and tensor table) read in one pass with `struct`.

gguf-py's GGUFReader builds numpy views for every array element, which takes ~15 s on
a 262k-token vocabulary (Gemma 3); this reads the same header in well under a second,
so `pipeserve validate` (which runs at every server start) can read every `.gguf`
source. Tensor data is never read here: the converter opens the file with gguf-py.

Layout (GGUF v2/v3, little-endian): magic, version u32, tensor count u64, KV count u64,
the KVs (string key, type u32, value), the tensor infos (name, n_dims u32, dims u64...,
type u32, offset u64), padding to `general.alignment` (32), then the tensor data.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALARS: dict[int, str] = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
                            10: "Q", 11: "q", 12: "d"}  # fmt: skip
_STRING, _ARRAY = 8, 9


class HeaderError(ValueError):
    """The header cannot be read (truncated, unknown value type, ...)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    tensor_type: GGMLQuantizationType
    data_offset: int  # from the start of the file

    @property
    def n_elements(self) -> int:
        count = 1
        for d in self.shape:
            count *= d
        return count

    @property
    def n_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.tensor_type]
        return self.n_elements * size // block


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise HeaderError(f"the header ends early (at byte {self.at})")
        (value,) = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += size
        return value

    def string(self) -> str:
        length = self.take("Q")
        end = self.at + length
        if end > len(self.data):
            raise HeaderError(f"the header ends early (a string at byte {self.at})")
        text = self.data[self.at : end].decode("utf-8", errors="replace")
        self.at = end
        return text

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.take("I"), self.take("Q")
            if item in _SCALARS and item != 7:
                return self.array(_SCALARS[item], count)
            return [self.value(item) for _ in range(count)]
        raise HeaderError(f"unknown metadata value type {kind} at byte {self.at}")

    def array(self, fmt: str, count: int) -> list[Any]:
        size = struct.calcsize(fmt) * count
        if self.at + size > len(self.data):
            raise HeaderError(f"the header ends early (an array at byte {self.at})")
        values = list(struct.unpack_from(f"<{count}{fmt}", self.data, self.at))
        self.at += size
        return values


def read_header(path: Path) -> tuple[dict[str, Any], list[TensorInfo]]:
    """(metadata, tensor infos) of GGUF `path`; HeaderError when it cannot be read."""
    data = path.read_bytes() if path.stat().st_size < (64 << 20) else _prefix(path)
    cursor = _Cursor(data)
    if cursor.take("4s") != b"GGUF":
        raise HeaderError("no GGUF magic at its start")
    version = cursor.take("I")
    if version not in (2, 3):
        raise HeaderError(f"GGUF version {version} (this reader reads versions 2 and 3)")
    tensor_count, kv_count = cursor.take("Q"), cursor.take("Q")
    meta: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        meta[key] = cursor.value(cursor.take("I"))
    infos = [_tensor_info(cursor) for _ in range(tensor_count)]
    alignment = int(meta.get("general.alignment", 32))
    start = -(-cursor.at // alignment) * alignment
    tensors = [TensorInfo(name, shape, kind, start + offset) for name, shape, kind, offset in infos]
    return meta, tensors


def _tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    name = cursor.string()
    dims = tuple(cursor.take("Q") for _ in range(cursor.take("I")))
    raw = cursor.take("I")
    try:
        kind = GGMLQuantizationType(raw)
    except ValueError:
        raise HeaderError(f"tensor {name} has GGML type id {raw}, which is not known") from None
    return name, dims, kind, cursor.take("Q")


def _prefix(path: Path) -> bytes:
    """The file's start, enough for any header (a big file's tensors are not read)."""
    with path.open("rb") as f:
        return f.read(64 << 20)
