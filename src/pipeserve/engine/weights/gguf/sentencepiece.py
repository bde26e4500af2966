"""The sentencepiece-style vocabulary of llama / mistral GGUFs (`tokenizer.ggml.model`
"llama") as a `tokenizers` BPE model, built the way transformers' GGUF loader builds it.

llama.cpp's SPM tokenizer replaces spaces with "▁", puts one "▁" in front of every piece
of text between special tokens (`tokenizer.ggml.add_space_prefix`, on unless the file
says otherwise), then merges the adjacent pair whose joined piece has the highest score,
and spells whatever is left without a token as its UTF-8 bytes (the `<0xNN>` tokens).
BPE with merges ranked by that score and byte fallback does the same; the "▁" comes from
a Prepend normalizer, which runs on each piece between special tokens, as llama.cpp and
sentencepiece (and Llama 2's own tokenizer.json) do. transformers' GGUF loader uses a
Metaspace pre-tokenizer instead, which prepends only at the very start and not to text
that already starts with a space: the two differ only on such text.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer, decoders, models, normalizers

SPACE = "\u2581"  # sentencepiece's visible space


def build_spm_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    scores: list[float] = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=merges_by_score(tokens, scores),
        unk_token=tokens[int(unk_id)] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(bpe)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    spaces = normalizers.Replace(" ", SPACE)
    tokenizer.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if prefix else spaces
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def merges_by_score(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best joined score first (ties: the longer
    left piece first, then vocabulary order), as sentencepiece's BPE converter ranks them."""
    ids = {token: i for i, token in enumerate(tokens)}
    ranked: list[tuple[float, int, int, int, int, int, str, str]] = []
    for at, (token, score) in enumerate(zip(tokens, scores, strict=True)):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                order = (at, ids[left], ids[right])
                ranked.append((-score, -len(left), -len(right), *order, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]
