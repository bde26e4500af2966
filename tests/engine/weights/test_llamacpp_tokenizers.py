"""Every pre-tokenizer name in the table (and the sentencepiece vocabulary) against
llama.cpp's `tokenize` on a corpus with code, whitespace runs, CJK, emoji, accents,
case changes, contractions, digit runs and the special tokens. The vocabulary is the
small one of gguf_fixtures.py (bytes and a few merges): it is the split, the byte
mapping, the merges' order and the special tokens that are compared, on every name."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeserve.engine.weights.gguf.tokenizer import PRE_TOKENIZERS
from tests.engine.weights.gguf_fixtures import write_tiny_gguf
from tests.engine.weights.llamacpp import run_llama
from tests.engine.weights.test_llamacpp import corpus_of

pytestmark = [pytest.mark.llamacpp, pytest.mark.mlx]

EXTRA = [
    "HelloWorld camelCase XMLHttpRequest don't I'LL we'Ve",
    "1234567 3.14159 2024-05-01 ١٢٣",
    "  the   theater\n\n\n   in\r\n12 x)",
    "Ünïcödé ÀÉÎÕÜ straße Ωμέγα Привет мир",
]


@pytest.mark.parametrize(
    ("vocab", "pre"), [("spm", "default")] + [("bpe", name) for name in sorted(PRE_TOKENIZERS)]
)
def test_token_ids_equal_llama_cpp(tmp_path: Path, vocab: str, pre: str) -> None:
    from pipeserve.engine.weights.gguf import ensure_converted
    from pipeserve.engine.weights.loader import load_tokenizer

    gguf = write_tiny_gguf(tmp_path / "t.gguf", vocab=vocab, pre=pre)
    corpus = corpus_of(vocab) + EXTRA
    reference = run_llama(gguf, [], 0, corpus, tmp_path)
    tokenizer = load_tokenizer(ensure_converted(gguf, tmp_path / "home"))
    for text, ids, with_bos in zip(corpus, reference["corpus"], reference["corpus_bos"],
                                   strict=True):  # fmt: skip
        assert tokenizer.encode(text, add_special_tokens=False) == ids, text
        if vocab == "spm":  # BOS added; special tokens in the text not parsed
            assert tokenizer.encode(text) == with_bos or "<" in text or "[" in text, text
