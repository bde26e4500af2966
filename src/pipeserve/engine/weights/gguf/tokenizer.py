"""A Hugging Face `tokenizer.json` + `tokenizer_config.json` from a GGUF's
`tokenizer.ggml.*` metadata: byte-level BPE (the `gpt2` tokenizer model) here, the
sentencepiece-style `llama` model in sentencepiece.py.

How text is split before BPE depends on the vocabulary: llama.cpp names the rule in
`tokenizer.ggml.pre`, and PRE_TOKENIZERS below gives each name's split (the same
regexes llama.cpp uses for it). A name not in the table is an error rather than a
guess: a wrong split gives different token ids, silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from pipeserve.engine.weights.gguf.files import GgufError
from pipeserve.engine.weights.gguf.sentencepiece import build_spm_tokenizer

# llama.cpp token types (gguf.TokenType).
UNKNOWN = 2
CONTROL = 3
USER_DEFINED = 4

_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Mistral's tekken (Nemo, Small 3): case changes split words; digits one by one.
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# OpenAI's o200k (gpt-oss, `gpt-4o`): tekken's word rule with contractions, 1-3 digits.
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    + _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    + _CONTRACTIONS
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    # Regexes applied one after the other before byte mapping (each splits the pieces
    # of the one before, as llama.cpp applies its list); empty: GPT-2's own regex.
    split: tuple[str, ...]
    digits: bool = False  # every digit its own piece first (llama.cpp's `\p{N}` rule)
    ignore_merges: bool = False  # a whole piece that is a token stays one (llama 3)


# llama.cpp's "default" (an older BPE file that names no pre-tokenizer): four regexes.
_DEFAULT_SPLITS = (
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)

_GPT2 = PreTokenizer(split=())
_DIGITS_GPT2 = PreTokenizer(split=(), digits=True)
_DEFAULT = PreTokenizer(split=_DEFAULT_SPLITS)
_QWEN2 = PreTokenizer(split=(_QWEN2_SPLIT,))
_LLAMA3 = PreTokenizer(split=(_LLAMA3_SPLIT,), ignore_merges=True)
_CL100K = PreTokenizer(split=(_LLAMA3_SPLIT,))  # llama 3's split, merges applied as ranked
_TEKKEN = PreTokenizer(split=(_TEKKEN_SPLIT,), ignore_merges=True)
_GPT4O = PreTokenizer(split=(_GPT4O_SPLIT,))

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "gpt-2": _GPT2,  # llama.cpp's name (it refuses "gpt2")
    "default": _DEFAULT,
    "smollm": _DIGITS_GPT2,
    "starcoder": _DIGITS_GPT2,
    "refact": _DIGITS_GPT2,
    "codeshell": _DIGITS_GPT2,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "smaug-bpe": _CL100K,
    "dbrx": _CL100K,  # OLMo 2
    "chatglm-bpe": _CL100K,  # GLM-4
    "glm4": _CL100K,
    "tekken": _TEKKEN,
    "gpt-4o": _GPT4O,
}


class UnsupportedTokenizer(GgufError):
    pass


def pre_tokenizer_of(name: str) -> PreTokenizer:
    try:
        return PRE_TOKENIZERS[name]
    except KeyError:
        known = ", ".join(sorted(PRE_TOKENIZERS))
        raise UnsupportedTokenizer(
            f"tokenizer.ggml.pre {name!r} is not supported (supported: {known})"
        ) from None


def check_tokenizer(meta: dict[str, Any]) -> None:
    """UnsupportedTokenizer unless the metadata names a tokenizer built here."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        pre_tokenizer_of(str(meta.get("tokenizer.ggml.pre", "default")))
    elif kind not in ("llama", "bert"):
        raise UnsupportedTokenizer(
            f"tokenizer.ggml.model {kind!r} is not supported "
            "(supported: gpt2 (byte-level BPE), llama (sentencepiece), bert (WordPiece))"
        )
    if not meta.get("tokenizer.ggml.tokens"):
        raise UnsupportedTokenizer("the file has no tokenizer.ggml.tokens (no vocabulary)")


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """The fast tokenizer the metadata describes."""
    check_tokenizer(meta)
    if meta.get("tokenizer.ggml.model") == "bert":
        from pipeserve.engine.weights.gguf.wordpiece import build_wordpiece

        return build_wordpiece(meta)
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    if meta.get("tokenizer.ggml.model") == "gpt2":
        tokenizer = _byte_level_tokenizer(meta)
    else:
        tokenizer = build_spm_tokenizer(meta)
    post_processor = _post_processor(meta, tokens)
    if post_processor is not None:
        tokenizer.post_processor = post_processor
    _add_special_tokens(tokenizer, tokens, meta.get("tokenizer.ggml.token_type") or [])
    return tokenizer


def adds_bos(meta: dict[str, Any]) -> bool:
    """llama.cpp adds BOS to a sentencepiece vocabulary whose file does not say."""
    default = meta.get("tokenizer.ggml.model") == "llama"
    return bool(meta.get("tokenizer.ggml.add_bos_token", default))


def _byte_level_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    pre = pre_tokenizer_of(str(meta.get("tokenizer.ggml.pre", "default")))
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    bpe = models.BPE(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=merges,
        ignore_merges=pre.ignore_merges,
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _pre_tokenizer(pre: PreTokenizer) -> pre_tokenizers.PreTokenizer:
    steps: list[pre_tokenizers.PreTokenizer] = []
    if pre.digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    for split in pre.split:
        steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not pre.split))
    return pre_tokenizers.Sequence(steps)


def _post_processor(meta: dict[str, Any], tokens: list[str]) -> processors.PostProcessor | None:
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if not adds_bos(meta) or bos_id is None:
        byte_level = meta.get("tokenizer.ggml.model") == "gpt2"
        return processors.ByteLevel(trim_offsets=False) if byte_level else None
    bos = tokens[int(bos_id)]
    return processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )


def _add_special_tokens(tokenizer: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control (and unknown) tokens match whole and are special; user-defined ones match
    whole too."""
    added = [
        AddedToken(tokens[i], special=kind != USER_DEFINED, normalized=False)
        for i, kind in enumerate(types)
        if kind in (UNKNOWN, CONTROL, USER_DEFINED)
    ]
    tokenizer.add_special_tokens([t for t in added if t.special])
    tokenizer.add_tokens([t for t in added if not t.special])


def tokenizer_config(meta: dict[str, Any], tokens: list[str]) -> dict[str, Any]:
    """tokenizer_config.json: special tokens, BOS handling and the chat template."""

    def token(key: str) -> str | None:
        value = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(value)] if value is not None and 0 <= int(value) < len(tokens) else None

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"),
        "unk_token": token("unknown_token_id"),
        "add_bos_token": adds_bos(meta),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config
