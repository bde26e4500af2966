"""Streaming detokenization with mlx-lm's detokenizers.

mlx-lm picks the right streaming detokenizer per tokenizer (byte-level BPE, SPM or the
naive decode-based one); each holds back bytes of an incomplete UTF-8 character until
it is complete. Special tokens decode as their text (the BPE token map holds them).

One change for byte-level BPE: mlx-lm trims a leading space off the first segment
and holds every single-space token back for that purpose. A continuation (after an
assistant prefill, or the second half of a scripted replay) must keep its spaces,
and `tokenizer.decode` keeps them too, so our copy never trims.

Two for SPM: the tokenizer's decoder strips one leading space off the whole text, but
mlx-lm strips it off every segment until some text was emitted (a lone "▁" first token
made the next word lose its space too); and mlx-lm turns the bytes of "▁" into a space
after byte fallback, where the decoder turns only pieces' "▁" into spaces. Our copy
strips once and replaces "▁" in the token map, so the stream equals one decode.
"""

from __future__ import annotations

import copy
from typing import Any

from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    SPMStreamingDetokenizer,
    StreamingDetokenizer,
)


class KeepSpaceBPEDetokenizer(BPEStreamingDetokenizer):
    """mlx-lm's BPE detokenizer without the leading-space trim (and no space hold-back)."""

    def _maybe_trim_space(self, current_text: str) -> str:
        return current_text

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        piece = self.tokenmap[token] if token < len(self.tokenmap) else "!"
        self._unflushed += piece
        text: str = self._decode_bytes(self._unflushed)  # type: ignore[no-untyped-call]
        if not text.endswith("\ufffd"):
            self.text += text
            self._unflushed = ""


class OneDecodeSPMDetokenizer(SPMStreamingDetokenizer):
    """mlx-lm's SPM detokenizer streaming exactly what one `tokenizer.decode` gives."""

    def reset(self) -> None:
        super().reset()  # type: ignore[no-untyped-call]
        self._space_to_strip = self.trim_space

    def _try_flush(self, force: bool = False) -> None:
        text = self._unflushed.decode("utf-8", "replace")
        if not force and text.endswith("\ufffd"):
            return
        if self._space_to_strip and text:
            self._space_to_strip = False
            text = text.removeprefix(" ")
        self.text += text
        self._unflushed = b""


def _spaces_in_pieces(tokenmap: list[bytes]) -> list[bytes]:
    """The token map with "▁" as a space in pieces; byte tokens (one byte each, and "▁"
    is three) keep their byte."""
    sep = SPMStreamingDetokenizer._sep
    return [piece.replace(sep, b" ") for piece in tokenmap]


class Detokenizers:
    """Makes a fresh streaming detokenizer per request from one prototype (cheap copy)."""

    def __init__(self, tokenizer: Any) -> None:
        prototype: StreamingDetokenizer = tokenizer.detokenizer
        if type(prototype) is BPEStreamingDetokenizer:
            # Reuse the (expensive) token map; only the behaviour changes.
            prototype.__class__ = KeepSpaceBPEDetokenizer
        elif type(prototype) is SPMStreamingDetokenizer:
            prototype.__class__ = OneDecodeSPMDetokenizer
            prototype.tokenmap = _spaces_in_pieces(prototype.tokenmap)
        self._prototype = prototype

    def new(self) -> StreamingDetokenizer:
        detokenizer = copy.copy(self._prototype)
        detokenizer.reset()
        return detokenizer


def flush(detokenizer: StreamingDetokenizer) -> str:
    """Finalize and return the text held back so far."""
    detokenizer.finalize()
    return str(detokenizer.last_segment)
