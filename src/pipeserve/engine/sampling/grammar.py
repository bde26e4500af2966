"""Grammar compilation for constrained decoding (llguidance), one compiler per model.

The compiler owns the model's llguidance tokenizer (built once, in the background,
from the Hugging Face tokenizer mlx-lm loaded: a few seconds for a 150k vocabulary)
and a cache of compiled grammars keyed by grammar text (the tokenizer is fixed per
compiler, so the key is effectively (tokenizer, grammar)). A request gets a fresh
matcher by copying the cached one, which is cheap. Compilation runs on a real OS
thread (`run_off_hub`) so a large schema never stalls the gevent hub.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from pipeserve.gevent_support import OsFlag, os_lock, start_os_thread

log = logging.getLogger("pipeserve.engine")

CACHE_SIZE = 256
T = TypeVar("T")


class GrammarError(ValueError):
    """A grammar or schema the engine cannot enforce; the message says why. `param`:
    the request field at fault when it is not the plan's own (a strict tool's schema)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class Constraint:
    """A request's grammar state, handed to the engine with its job."""

    matcher: Any  # llguidance.LLMatcher, already past any forced prefix
    vocab_size: int  # the mask's width in tokens
    eos_ids: tuple[int, ...]  # allowed once the grammar is complete
    # True when the request is still right without enforcement (a forced tool call,
    # whose prompt prefill already opens the call): engines that cannot enforce may drop it.
    optional: bool = False
    # The grammar text and forced prefix the matcher was made from: a matcher cannot be
    # pickled, so a job sent to another process rebuilds its constraint from these.
    grammar: str = ""
    forced: str = ""


def build_lltokenizer(tokenizer: Any, vocab_size: int | None, eos_ids: Iterable[int]) -> Any:
    """llguidance's tokenizer for any fast (Rust-backed) Hugging Face tokenizer.

    `tokenizer` is mlx-lm's TokenizerWrapper or a transformers tokenizer; the vocabulary
    is sized to the model's logits (`vocab_size`, which may exceed the tokenizer's).
    """
    import llguidance

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise GrammarError(
            f"structured output needs a fast (tokenizers-backed) tokenizer; "
            f"this model has {type(hf).__name__}"
        )
    backend = backend.__class__.from_str(backend.to_str())  # a copy we may reconfigure
    backend.no_padding()
    backend.no_truncation()
    size = len(hf)
    n_vocab = max(vocab_size or 0, size)
    eos = sorted(set(eos_ids)) or [getattr(hf, "eos_token_id", 0) or 0]
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos)


class GrammarCompiler:
    """Compiles llguidance grammars for one model's tokenizer; thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int | None, eos_ids: Iterable[int]) -> None:
        self._source = (tokenizer, vocab_size, frozenset(eos_ids))
        self._ready = OsFlag()
        self._started = False
        self._llt: Any = None
        self._error: str | None = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = os_lock()

    def warm_up(self) -> None:
        """Start building the tokenizer on its own OS thread (once); returns at once."""
        with self._lock:
            if self._started:
                return
            self._started = True
        start_os_thread(self._build, name="pipeserve-grammar-tokenizer")

    def _build(self) -> None:
        try:
            self._llt = build_lltokenizer(*self._source)
        except Exception as exc:
            log.warning("structured output unavailable: %s", exc)
            self._error = str(exc)
        finally:
            self._source = (None, None, frozenset())
            self._ready.set()

    @property
    def tokenizer(self) -> Any:
        """The llguidance tokenizer (built on first use, a few seconds; then cached)."""
        self.warm_up()
        self._ready.wait()
        if self._llt is None:
            raise GrammarError(self._error or "structured output is unavailable for this model")
        return self._llt

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.vocab_size)

    @property
    def eos_ids(self) -> list[int]:
        return list(self.tokenizer.eos_tokens)

    def constraint(self, grammar: str, forced: str = "", optional: bool = False) -> Constraint:
        """A request's constraint: a fresh matcher that has consumed the `forced` text
        (an assistant prefill the grammar covers); GrammarError if either is invalid."""
        matcher = self.compile(grammar)
        if forced and not matcher.consume_tokens(self.encode(forced)):
            raise GrammarError(f"the forced prefix {forced!r} does not fit the grammar")
        llt = self.tokenizer
        return Constraint(
            matcher, int(llt.vocab_size), tuple(llt.eos_tokens), optional, grammar, forced
        )

    def compile(self, grammar: str) -> Any:
        """A fresh matcher for `grammar` (llguidance grammar JSON); GrammarError if invalid."""
        with self._lock:
            template = self._cache.get(grammar)
            if template is not None:
                self._cache.move_to_end(grammar)
                return template.deep_copy()
        template = self._new_matcher(grammar)
        with self._lock:
            self._cache[grammar] = template
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return template.deep_copy()

    def _new_matcher(self, grammar: str) -> Any:
        import llguidance

        llt = self.tokenizer
        problem = llguidance.LLMatcher.validate_grammar(grammar, llt)
        if problem:
            raise GrammarError(_first_line(problem))
        matcher = llguidance.LLMatcher(llt, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        return matcher

    def encode(self, text: str) -> list[int]:
        """Token ids of text, special-token markers recognized."""
        return list(self.tokenizer.tokenize_str(text, parse_special=True))

    def is_special(self, token_id: int) -> bool:
        return bool(self.tokenizer.is_special_token(token_id))

    def decode_bytes(self, ids: list[int]) -> bytes:
        return bytes(self.tokenizer.decode_bytes(ids))


def _first_line(message: str) -> str:
    """llguidance errors carry a parser-state dump after the first lines; keep the reason."""
    text = message.strip().split("\n<state>")[0].strip()
    return text[:500]
