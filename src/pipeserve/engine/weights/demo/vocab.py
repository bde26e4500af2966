"""Byte-level BPE tokenizers built offline from quicktok's rank tables.

quicktok ships tiktoken-style rank tables (`<name>.vocab`: u32 count, then records of
u16 length, bytes, u32 rank). A rank table is a BPE model (tiktoken merges the
adjacent pair whose concatenation has the lowest rank); a HF BPE model with one merge
per token, ordered by rank, encodes the same. The derived vocab + merges are cached per
table (JSON under the pipeserve home).
"""

from __future__ import annotations

import base64
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
O200K_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CL100K_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class VocabSpec:
    """One quicktok rank table and how text is split before BPE."""

    table: str  # quicktok data file stem: qwen3, o200k, cl100k
    pattern: str
    nfc: bool = False


VOCABS: dict[str, VocabSpec] = {
    "qwen3": VocabSpec("qwen3", QWEN_PATTERN, nfc=True),
    "o200k": VocabSpec("o200k", O200K_PATTERN),
    "cl100k": VocabSpec("cl100k", CL100K_PATTERN),
    "llama3": VocabSpec("llama3", CL100K_PATTERN),  # Llama 3 splits text as cl100k does
}


def quicktok_data_dir() -> Path:
    import quicktok

    return Path(quicktok.__file__).parent / "data"


@cache
def read_ranks(table: str) -> tuple[bytes, ...]:
    """The token byte strings of a quicktok rank table, indexed by rank."""
    data = (quicktok_data_dir() / f"{table}.vocab").read_bytes()
    (count,) = struct.unpack_from("<I", data, 0)
    tokens: list[bytes | None] = [None] * count
    offset = 4
    for _ in range(count):
        (length,) = struct.unpack_from("<H", data, offset)
        raw = data[offset + 2 : offset + 2 + length]
        (rank,) = struct.unpack_from("<I", data, offset + 2 + length)
        offset += 6 + length
        tokens[rank] = raw
    if any(t is None for t in tokens):
        raise ValueError(f"quicktok table {table!r} has gaps in its ranks")
    return tuple(t for t in tokens if t is not None)


def read_specials(name: str) -> dict[str, int]:
    """quicktok `<name>.special`: u32 count, then records of u32 id, u16 length, bytes."""
    data = (quicktok_data_dir() / f"{name}.special").read_bytes()
    (count,) = struct.unpack_from("<I", data, 0)
    specials: dict[str, int] = {}
    seen: set[int] = set()
    offset = 4
    for _ in range(count):
        token_id, length = struct.unpack_from("<IH", data, offset)
        if token_id not in seen:  # o200k_harmony names id 200018 twice; the first wins
            seen.add(token_id)
            specials[data[offset + 6 : offset + 6 + length].decode()] = token_id
        offset += 6 + length
    return specials


@cache
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def derive_merges(tokens: tuple[bytes, ...]) -> list[tuple[int, int]]:
    """One (left rank, right rank) merge per token, in the token's rank order.

    The split of token t is where BPE over t's own bytes, using only lower ranks, stops
    with two parts. This reproduces the real Qwen merge list (151,387 merges) and
    encodes exactly like tiktoken/quicktok (tested), with far fewer merges than taking
    every split (faster tokenizer loads).
    """
    rank = {tok: i for i, tok in enumerate(tokens)}
    merges: list[tuple[int, int]] = []
    for r, tok in enumerate(tokens):
        if len(tok) < 2:
            continue
        parts = _bpe_parts(tok, rank, r)
        if len(parts) == 2:
            merges.append((rank[parts[0]], rank[parts[1]]))
    return merges


def _bpe_parts(tok: bytes, rank: dict[bytes, int], limit: int) -> list[bytes]:
    """tiktoken's merge loop over tok's bytes with ranks below `limit`, stopping at 2 parts."""
    parts = [tok[i : i + 1] for i in range(len(tok))]
    while len(parts) > 2:
        best, at = limit, -1
        for i in range(len(parts) - 1):
            r = rank.get(parts[i] + parts[i + 1], limit)
            if r < best:
                best, at = r, i
        if at < 0:
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts


def bpe_model_json(table: str, cache_dir: Path) -> Path:
    """vocab + merges of a rank table as JSON (cached; written atomically)."""
    path = cache_dir / f"bpe-{table}.json"
    if path.exists():
        return path
    tokens = read_ranks(table)
    to_unicode = _byte_to_unicode()
    names = ["".join(to_unicode[b] for b in tok) for tok in tokens]
    merges = [[names[a], names[b]] for a, b in derive_merges(tokens)]
    payload = {"vocab": {name: i for i, name in enumerate(names)}, "merges": merges}
    write_atomic(path, json.dumps(payload, ensure_ascii=False).encode())
    return path


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def build_tokenizer(vocab: str, specials: dict[str, int], cache_dir: Path) -> Tokenizer:
    """A HF byte-level BPE tokenizer for a quicktok table plus special tokens at given ids.

    Special-token ids must lie after the table's ranks; gaps are filled with
    `<|reserved_N|>` placeholders so that the ids are exactly the requested ones.
    """
    spec = VOCABS[vocab]
    payload = json.loads(bpe_model_json(spec.table, cache_dir).read_text(encoding="utf-8"))
    merges = [tuple(m) for m in payload["merges"]]
    tokenizer = Tokenizer(models.BPE(payload["vocab"], merges, ignore_merges=False))
    if spec.nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(spec.pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    base = len(payload["vocab"])
    by_id = {token_id: text for text, token_id in specials.items()}
    if min(by_id, default=base) < base:
        raise ValueError("special-token ids must follow the rank table")
    added = [
        AddedToken(by_id.get(i, f"<|reserved_{i}|>"), special=True, normalized=False)
        for i in range(base, max(by_id, default=base - 1) + 1)
    ]
    tokenizer.add_special_tokens(added)
    for text, token_id in specials.items():
        if tokenizer.token_to_id(text) != token_id:
            raise ValueError(f"special token {text!r} got id {tokenizer.token_to_id(text)}")
    return tokenizer


def tiktoken_file(table: str) -> bytes:
    """The table as a `.tiktoken` file (base64 bytes, space, rank per line)."""
    lines = (
        base64.b64encode(tok) + b" " + str(rank).encode()
        for rank, tok in enumerate(read_ranks(table))
    )
    return b"\n".join(lines) + b"\n"
