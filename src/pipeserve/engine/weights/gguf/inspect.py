"""What a GGUF file holds, read from its header alone (header.py; no tensor data): used by `pipeserve validate` (every problem that would stop the
conversion, as one line naming the file) and `validate --explain` (architecture,
parameters, tensor types, context, template, memory), and by the converter itself.

Problems found here, each a GgufError naming the file: no GGUF magic, a header that
cannot be read (header.py: a file cut inside it, an unknown tensor type id), an architecture or tensor
type the converter does not handle, a tensor whose data would run past the next
tensor's or the file's end (its size does not match its shape and type).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeserve.engine.weights.gguf.architectures import ARCHITECTURES, Architecture
from pipeserve.engine.weights.gguf.files import GgufError, check_gguf_file
from pipeserve.engine.weights.gguf.header import HeaderError, TensorInfo, read_header
from pipeserve.engine.weights.gguf.tensors import GROUP_SIZE, QUANT_WIDTHS, REQUANT_BITS

PLAIN_TYPES: tuple[str, ...] = ("F32", "F16", "BF16")
_QUANT_TYPES = sorted(QUANT_WIDTHS, key=lambda kind: (kind.endswith("_K"), kind))  # K-quants last
SUPPORTED_TYPES = ", ".join((*PLAIN_TYPES, *_QUANT_TYPES))
# Types refused by name, and why (the i-quants' codebooks and the ternary types have no
# affine form; re-quantizing them would stack a second error on an already lossy format).
REFUSED_WHY = (
    "its weights are codebook or ternary entries with no affine form; re-quantize the "
    "model from its original weights to Q4_K / Q5_K / Q8_0 instead"
)

REFUSED_OTHER: dict[str, str] = {}


@dataclass(frozen=True)
class GgufFile:
    """A parsed header: metadata and the tensor table (header.py; no tensor data)."""

    path: Path
    meta: dict[str, Any]
    tensors: list[TensorInfo]

    @property
    def types(self) -> dict[str, str]:
        return {t.name: t.tensor_type.name for t in self.tensors}

    @property
    def architecture_name(self) -> str:
        return str(self.meta.get("general.architecture"))


def open_gguf(path: Path) -> GgufFile:
    """The header of GGUF `path`, or GgufError saying what is wrong with the file."""
    check_gguf_file(path)
    try:
        meta, tensors = read_header(path)
    except HeaderError as exc:
        size = path.stat().st_size
        raise GgufError(f"{path}: cannot read its GGUF header ({size} bytes): {exc}") from None
    return GgufFile(path, meta, tensors)


def architecture(file: GgufFile) -> Architecture:
    name = file.architecture_name
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise GgufError(
            f"{file.path}: GGUF architecture {name!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        ) from None


def check_tensor_types(file: GgufFile) -> None:
    for name, kind in file.types.items():
        if kind in PLAIN_TYPES or kind in QUANT_WIDTHS:
            continue
        why = f": {REFUSED_WHY}" if kind.startswith(("IQ", "TQ")) else REFUSED_OTHER.get(kind, "")
        raise GgufError(
            f"{file.path}: tensor {name} has GGUF type {kind}, which is not supported "
            f"(supported: {SUPPORTED_TYPES}){why}"
        )


def check_tensor_sizes(file: GgufFile) -> None:
    """Each tensor's data (its shape times its type's size) ends before the next one
    starts and within the file."""
    ordered = sorted(file.tensors, key=lambda t: int(t.data_offset))
    if not ordered:
        raise GgufError(f"{file.path}: the file holds no tensors (metadata only: not a model)")
    size = file.path.stat().st_size
    for tensor, following in zip(ordered, [*ordered[1:], None], strict=True):
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        limit = size if following is None else int(following.data_offset)
        if end > limit:
            shape = "x".join(str(int(d)) for d in tensor.shape)
            what = "the end of the file" if following is None else f"tensor {following.name}"
            raise GgufError(
                f"{file.path}: tensor {tensor.name} ({tensor.tensor_type.name}, {shape}) needs "
                f"{int(tensor.n_bytes)} bytes but runs {end - limit} bytes into {what} "
                "(its size does not match its shape: a truncated or corrupt file)"
            )


def check_convertible(file: GgufFile) -> Architecture:
    """Every check the conversion would fail on before reading a weight."""
    arch = architecture(file)
    check_tensor_types(file)
    check_tensor_sizes(file)
    from pipeserve.engine.weights.gguf.tokenizer import check_tokenizer

    try:
        check_tokenizer(file.meta)
        if arch.encoder:
            from pipeserve.engine.weights.gguf.encoder import bert_name

            for name in file.types:
                bert_name(name)
    except GgufError as error:
        raise GgufError(f"{file.path}: {error}") from None
    return arch


@dataclass(frozen=True)
class GgufSummary:
    """What `validate --explain` says about a GGUF file."""

    path: Path
    architecture: str
    model_type: str
    parameters: int
    tensor_types: dict[str, int]  # GGUF type -> number of tensors
    context_length: int | None
    chat_template: str
    special_tokens: frozenset[str]
    weight_bytes: int  # the weights as pipeserve holds them on the CPU
    kv_bytes_per_token: int  # float32 keys and values, every layer
    key_length: int = 0  # per attention head
    value_length: int = 0
    encoder: bool = False  # an embedding model (no KV cache, no chat)

    def lines(self) -> list[str]:
        types = ", ".join(f"{kind} x{count}" for kind, count in self.tensor_types.items())
        requant = [f"{k} -> {REQUANT_BITS[k]} bit" for k in self.tensor_types if k in REQUANT_BITS]
        context = self.context_length if self.context_length is not None else "not set"
        template = "present" if self.chat_template else "none (an embedding model)" if (
            self.encoder
        ) else (
            "none (a base model: /v1/completions and raw prompts work; chat requests "
            "answer 400 until the model entry sets `chat_template:`)"
        )  # fmt: skip
        lines = [
            f"GGUF {self.path.name}: architecture {self.architecture} "
            f"(mlx-lm {self.model_type}), {self.parameters / 1e6:.1f}M parameters, "
            f"context {context}",
            f"tensor types: {types}"
            + (f" (re-quantized: {', '.join(requant)})" if requant else ""),
            f"chat template: {template}",
            f"memory: weights {self.weight_bytes / 2**20:.0f} MiB, KV cache "
            f"{self.kv_bytes_per_token * 1024 / 2**20:.1f} MiB per 1024 tokens "
            f"({self.kv_bytes_per_token} bytes per token)"
            if not self.encoder
            else f"memory: weights {self.weight_bytes / 2**20:.1f} MiB (float32), no KV cache",
        ]
        return lines


def _held_bytes(name: str, kind: str, count: int) -> int:
    """Bytes of `count` weights as loaded on the CPU: quantized types as MLX blocks (the
    CPU kernels keep them), float types and mixture-of-experts weights (`*_exps`: the
    kernels do not take them, they are dequantized at load) as float32."""
    if kind in QUANT_WIDTHS and "_exps" not in name:
        return count * QUANT_WIDTHS[kind] // 8 + count // GROUP_SIZE * 4
    return count * 4


def summarize(file: GgufFile) -> GgufSummary:
    arch = check_convertible(file)
    meta, name = file.meta, file.architecture_name

    def number(key: str) -> int | None:
        value = meta.get(f"{name}.{key}")
        return int(value) if isinstance(value, (int, float)) else None

    layers, heads = number("block_count") or 0, number("attention.head_count") or 1
    kv_heads = number("attention.head_count_kv") or heads
    key_length = number("attention.key_length") or (number("embedding_length") or 0) // heads
    value_length = number("attention.value_length") or key_length
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    types: list[int] = meta.get("tokenizer.ggml.token_type") or []
    specials = frozenset(tokens[i] for i, kind in enumerate(types) if kind in (3, 4))
    counts = Counter(t.tensor_type.name for t in file.tensors)
    return GgufSummary(
        path=file.path,
        architecture=name,
        model_type=arch.model_type,
        parameters=sum(int(t.n_elements) for t in file.tensors),
        tensor_types=dict(counts.most_common()),
        context_length=number("context_length"),
        chat_template=str(meta.get("tokenizer.chat_template") or ""),
        special_tokens=specials,
        weight_bytes=sum(
            int(t.n_elements) * 4
            if arch.encoder
            else _held_bytes(t.name, t.tensor_type.name, t.n_elements)
            for t in file.tensors
        ),  # fmt: skip
        kv_bytes_per_token=0
        if arch.encoder
        else layers * kv_heads * (key_length + value_length) * 4,
        key_length=key_length,
        value_length=value_length,
        encoder=arch.encoder,
    )


def inspect_gguf(path: Path) -> GgufSummary:
    """The summary of GGUF `path`; GgufError (naming the file) when it cannot be served."""
    return summarize(open_gguf(path))
