"""server/tokenize.py's tokenizer work on the tokenizer kinds it meets: byte-level BPE
(the demo models) and a sentencepiece vocabulary with a BOS (a tiny GGUF), without a
server (tests/server/test_llama_cpp_routes.py drives the routes)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeserve.engine.weights.gguf import ensure_converted
from pipeserve.engine.weights.loader import load_tokenizer
from pipeserve.request import TokenizeRequest
from pipeserve.server.tokenize import text_tokens, token_pieces
from tests.engine.weights.gguf_fixtures import write_tiny_gguf

TEXTS = ["hello world 日本 (x) é", "日本語", " the theater", "<s>a"]


def joined(pieces: list[str | list[int]]) -> bytes:
    return b"".join(p.encode() if isinstance(p, str) else bytes(p) for p in pieces)


def test_sentencepiece_bos_pieces_and_bytes(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(
        ensure_converted(write_tiny_gguf(tmp_path / "m.gguf", vocab="spm"), tmp_path)
    )
    hf = tokenizer._tokenizer
    for text in TEXTS:
        plain = text_tokens(hf, TokenizeRequest(None, content=text))
        assert plain == hf.encode(text, add_special_tokens=False)
        special = text_tokens(hf, TokenizeRequest(None, content=text, add_special=True))
        assert special == [hf.bos_token_id, *plain] == hf.encode(text)  # llama.cpp's BOS
        pieces = token_pieces(tokenizer, plain)
        assert joined(pieces).decode().lstrip(" ") == hf.decode(plain).lstrip(" ")
    # "語" is not a piece: its three bytes are three byte tokens, none UTF-8 alone
    pieces = token_pieces(tokenizer, text_tokens(hf, TokenizeRequest(None, content="語")))
    assert [p for p in pieces if isinstance(p, list)] == [[0xE8], [0xAA], [0x9E]]
    # "<s>" read as the BOS token, or as text
    assert text_tokens(hf, TokenizeRequest(None, content="<s>"))[-1] == hf.bos_token_id
    as_text = text_tokens(hf, TokenizeRequest(None, content="<s>", parse_special=False))
    assert hf.bos_token_id not in as_text and hf.decode(as_text).strip() == "<s>"


def test_byte_level_pieces(demo_tokenizer: Callable[[str], Any]) -> None:
    tokenizer = demo_tokenizer("qwen3")
    hf = tokenizer._tokenizer
    text = "emoji \U0001f680 and 日本語<|im_end|>"
    ids = text_tokens(hf, TokenizeRequest(None, content=text))
    pieces = token_pieces(tokenizer, ids)
    assert joined(pieces) == text.encode()
    assert "<|im_end|>" in pieces  # a special token's piece is its text
    assert any(isinstance(p, list) for p in pieces)  # the rocket spans byte tokens
    assert text_tokens(hf, TokenizeRequest(None, content=text, add_special=True)) == ids  # no BOS


def test_the_gguf_corpus_round_trips_on_gguf_tokenizers(
    tmp_path: Path, smollm2: tuple[Path, Path]
) -> None:
    """The strings the GGUF tokenizer tests use, on the tiny GGUF's byte-level BPE and on
    SmolLM2's: tokenize (as /tokenize does) then decode (as /detokenize does) gives the
    text back, and the pieces spell its bytes."""
    from tests.engine.weights.test_gguf_convert import STRINGS

    tiny = ensure_converted(write_tiny_gguf(tmp_path / "m.gguf", pre="qwen2"), tmp_path)
    for folder in (tiny, smollm2[1]):
        tokenizer = load_tokenizer(folder)
        hf = tokenizer._tokenizer
        for text in STRINGS:
            for parse_special in (True, False):
                request = TokenizeRequest(None, content=text, parse_special=parse_special)
                ids = text_tokens(hf, request)
                assert hf.decode(ids) == text, (folder.name, text)
                assert joined(token_pieces(tokenizer, ids)) == text.encode(), text
