"""Fill-in-the-middle prompts for render_template: the vocabulary's FIM tokens, found as
data (FIM_STYLES), and the two layouts.

- plain (Completions' and Ollama's `suffix`): `[BOS] PRE prefix SUF suffix MID`, the
  layout the models document (Qwen2.5-Coder: `<|fim_prefix|>{prefix}<|fim_suffix|>
  {suffix}<|fim_middle|>`; StarCoder the same with `<fim_prefix>`...).
- repo-level (`/infill`, llama.cpp's server `format_infill`): `[REPO "myproject\\n"]`,
  then for each extra file `SEP "{filename}\\n" text` (without a separator token: a
  `--- snippet ---` line), then `SEP "filename\\n"`, then `[BOS] PRE prefix prompt SUF
  suffix MID`, with llama.cpp's truncation (the last 3/4 of a 2048-token batch of
  prefix, the first quarter less the prompt of suffix, the extra context from the end).

The code itself is tokenized without reading special tokens in it (text that spells
`<|fim_middle|>` stays text), as llama.cpp does. The middle ends at the model's EOS, at
the style's padding or end-of-text token, or at its repository or file-separator token
(llama.cpp's end-of-generation tokens).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeserve.request import FillInMiddle


@dataclass(frozen=True)
class FimStyle:
    """One vocabulary's FIM tokens: the three that lay out the prompt (all must be single
    tokens of the vocabulary), and the optional ones, each given as candidates."""

    name: str
    prefix: str
    suffix: str
    middle: str
    ends: tuple[str, ...] = ()  # tokens that end the middle besides EOS (pad, end of text)
    repo: tuple[str, ...] = ()
    file_sep: tuple[str, ...] = ()


FIM_STYLES: tuple[FimStyle, ...] = (
    # Qwen2.5-Coder, Qwen3 (and CodeGemma's <|fim_*|> with <|file_separator|>)
    # (Qwen2.5-Coder's instruct GGUFs name <|im_end|> their EOS; a middle ends at <|endoftext|>)
    FimStyle("fim-pipes", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>",
             ("<|fim_pad|>", "<|endoftext|>"), ("<|repo_name|>",),
             ("<|file_sep|>", "<|file_separator|>")),
    # StarCoder, StarCoder2
    FimStyle("fim-underscore", "<fim_prefix>", "<fim_suffix>", "<fim_middle>",
             ("<fim_pad>", "<|endoftext|>"), ("<repo_name>", "<reponame>"), ("<file_sep>",)),
    # SantaCoder
    FimStyle("fim-dash", "<fim-prefix>", "<fim-suffix>", "<fim-middle>",
             ("<fim-pad>", "<|endoftext|>"), ("<fim-repo>",), ("<fim-sep>",)),
    # DeepSeek-Coder
    FimStyle("deepseek", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>",
             ("<｜end▁of▁sentence｜>",)),
)  # fmt: skip

STYLE_NAMES = ", ".join(f"{s.prefix} {s.suffix} {s.middle}" for s in FIM_STYLES)
BATCH = 2048  # llama.cpp's default n_batch, which its /infill truncation is relative to
SNIPPET = "\n\n--- snippet ---\n\n"  # llama.cpp's separator of extra files without SEP


@dataclass(frozen=True)
class FimTokens:
    """The ids of one vocabulary's FIM tokens (None: the vocabulary has no such token)."""

    style: str
    prefix: int
    suffix: int
    middle: int
    repo: int | None
    file_sep: int | None
    ends: frozenset[int]  # besides EOS, these end the middle


def find_fim_tokens(vocab: Mapping[str, int]) -> FimTokens | None:
    """The first style whose prefix, suffix and middle tokens are all in `vocab`."""
    for style in FIM_STYLES:
        core = [vocab.get(t) for t in (style.prefix, style.suffix, style.middle)]
        if any(token_id is None for token_id in core):
            continue
        repo, sep = first_in(vocab, style.repo), first_in(vocab, style.file_sep)
        prefix, suffix, middle = (int(token_id or 0) for token_id in core)
        found = [vocab.get(t) for t in style.ends] + [repo, sep]
        ends = frozenset(t for t in found if t is not None)
        return FimTokens(style.name, prefix, suffix, middle, repo, sep, ends)
    return None


def first_in(vocab: Mapping[str, int], candidates: tuple[str, ...]) -> int | None:
    return next((vocab[c] for c in candidates if c in vocab), None)


@dataclass(frozen=True)
class FimLayout:
    """Lays out FIM prompts for one tokenizer (a Hugging Face tokenizer)."""

    tokens: FimTokens
    bos: tuple[int, ...]  # what the tokenizer puts before a text by default (BOS)
    tokenizer: Any

    @classmethod
    def of(cls, tokenizer: Any) -> FimLayout | None:
        """The layout of `tokenizer`'s vocabulary, or None when it has no FIM tokens."""
        tokens = find_fim_tokens(tokenizer.get_vocab())
        if tokens is None:
            return None
        bos_id = getattr(tokenizer, "bos_token_id", None)
        leading = tokenizer.encode("", add_special_tokens=True)
        bos = tuple(t for t in leading[:1] if bos_id is not None and t == bos_id)
        return cls(tokens, bos, tokenizer)

    def code(self, text: str) -> list[int]:
        """Code text as tokens, special-token spellings in it kept as text."""
        if not text:
            return []
        ids = self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        return list(ids)

    def text(self, text: str) -> list[int]:
        """Text with special tokens read (llama.cpp reads them in /infill's `prompt`)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def prompt(self, prefix: list[int], fim: FillInMiddle, context_length: int | None) -> list[int]:
        """The prompt's token ids; prefix: the prefix's tokens (code() of the text).
        context_length: the model's, for how much extra context fits (llama.cpp keeps
        the last n_ctx - n_batch - 2 * n_predict tokens of it, n_predict being -1; None:
        all of it)."""
        t = self.tokens
        suffix = self.code(fim.suffix)
        if not fim.repo_level:
            return [*self.bos, t.prefix, *prefix, t.suffix, *suffix, t.middle]
        prompt = self.text(fim.prompt)
        prefix = prefix[len(prefix) - min(len(prefix), 3 * (BATCH // 4)) :]
        suffix = suffix[: max(0, BATCH // 4 - (2 + len(prompt)))]
        extra = self.repo_context(fim.extra)
        room = len(extra) if context_length is None else max(0, context_length - BATCH + 2)
        extra = extra[len(extra) - min(room, len(extra)) :]
        middle = [*self.bos, t.prefix, *prefix, *prompt, t.suffix, *suffix, t.middle]
        return extra + middle

    def repo_context(self, files: tuple[tuple[str, str], ...]) -> list[int]:
        """llama.cpp's repository-level context before the FIM prefix."""
        t = self.tokens
        out: list[int] = []
        if t.repo is not None:
            out += [t.repo, *self.code("myproject\n")]
        for filename, text in files:
            if t.file_sep is not None:
                out += [t.file_sep, *self.code(filename + "\n")]
            else:
                out += self.code(SNIPPET)
            out += self.code(text)
        if t.file_sep is not None:
            out += [t.file_sep, *self.code("filename\n")]
        return out


def no_fim_message(model_name: str, param: str) -> str:
    return (
        f"Invalid value for '{param}': model {model_name!r} cannot fill in the middle: "
        "its vocabulary has no "
        f"fill-in-the-middle tokens (known styles: {STYLE_NAMES})."
    )


__all__ = ["FIM_STYLES", "FimLayout", "FimStyle", "FimTokens", "find_fim_tokens", "no_fim_message"]
