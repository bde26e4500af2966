"""Releasing the Python copies of a tokenizer's vocabulary and merges after it is built.

transformers 5 tokenizer classes (Qwen2, Llama, Gemma, ... on the `tokenizers` backend)
keep the vocabulary dict and the merges list their `__init__` built the Rust tokenizer
from, as `_vocab` and `_merges`: ~50 MB of Python objects for a 150k-token vocabulary
(Qwen2.5: the tokenizer costs 105 MB resident with them, 55 MB without), in every process
that holds the tokenizer. Encoding, decoding, `get_vocab` and chat templates all go to
the Rust tokenizer; an attribute is released only where no method of the class (or its
bases) other than `__init__` names it, so a class that does read it later keeps it.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("pipeserve.engine")

CONSTRUCTION_TABLES = ("_vocab", "_merges")


def read_after_init(cls: type, attribute: str) -> bool:
    """Whether a method of `cls` or its bases other than `__init__` names `attribute`
    (its code objects' attribute names, nested functions included)."""
    for klass in cls.__mro__:
        for name, member in vars(klass).items():
            function = getattr(member, "__func__", member)
            code = getattr(function, "__code__", None)
            if name != "__init__" and code is not None and _names(code, attribute):
                return True
    return False


def _names(code: Any, attribute: str) -> bool:
    if attribute in code.co_names:
        return True
    return any(_names(const, attribute) for const in code.co_consts if hasattr(const, "co_names"))


def release_construction_tables(tokenizer: Any) -> list[str]:
    """Drop the construction-only tables of a Hugging Face tokenizer (or mlx-lm's wrapper
    around one); the names released."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    hf = tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer
    released = []
    for attribute in CONSTRUCTION_TABLES:
        held = vars(hf).get(attribute) if hasattr(hf, "__dict__") else None
        if isinstance(held, dict | list) and not read_after_init(type(hf), attribute):
            delattr(hf, attribute)
            released.append(attribute)
    return released
