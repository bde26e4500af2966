"""Streaming detokenization with mlx-lm's detokenizers.

mlx-lm picks the right streaming detokenizer per tokenizer (byte-level BPE, SPM or the
naive decode-based one); each holds back bytes of an incomplete UTF-8 character until
it is complete. Special tokens decode as their text (the BPE token map holds them).

One change for byte-level BPE: mlx-lm trims a leading space off the first segment
and holds every single-space token back for that purpose. A continuation (after an
assistant prefill, or the second half of a scripted replay) must keep its spaces,
and `tokenizer.decode` keeps them too, so our copy never trims.
"""

from __future__ import annotations

import copy
from typing import Any

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, StreamingDetokenizer


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


class Detokenizers:
    """Makes a fresh streaming detokenizer per request from one prototype (cheap copy)."""

    def __init__(self, tokenizer: Any) -> None:
        prototype: StreamingDetokenizer = tokenizer.detokenizer
        if type(prototype) is BPEStreamingDetokenizer:
            # Reuse the (expensive) token map; only the behaviour changes.
            prototype.__class__ = KeepSpaceBPEDetokenizer
        self._prototype = prototype

    def new(self) -> StreamingDetokenizer:
        detokenizer = copy.copy(self._prototype)
        detokenizer.reset()
        return detokenizer


def flush(detokenizer: StreamingDetokenizer) -> str:
    """Finalize and return the text held back so far."""
    detokenizer.finalize()
    return str(detokenizer.last_segment)
