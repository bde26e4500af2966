"""The WordPiece tokenizer of a BERT GGUF (`tokenizer.ggml.model: bert`), built as
llama.cpp tokenizes with it (its WPM tokenizer, llama-vocab.cpp):

- the vocabulary is stored in "phantom space" form by llama.cpp's converter: a
  word-initial piece as `▁piece`, a continuation (`##piece` in BERT's vocab.txt) as
  `piece`, `[CLS]`-style specials as they are; turned back into BERT's form here;
- the text is NFD-normalised, stripped of control characters and accents (combining
  marks) and lower-cased, as BERT's own uncased tokenizer does;
- words split at whitespace, punctuation, ASCII symbols and each CJK character; each
  word is matched longest piece first, the whole word [UNK] when a piece is missing;
- `[CLS] text [SEP]` around a sequence (`[SEP] second [SEP]` after it for a pair).
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, processors

from pipeserve.engine.weights.gguf.files import GgufError

PHANTOM_SPACE = "\u2581"
CONTINUATION = "##"
_CONTROL = 3  # llama.cpp's token type of control tokens ([CLS], [SEP], ...)


def bert_vocabulary(tokens: list[str]) -> list[str]:
    """llama.cpp's phantom-space pieces back in vocab.txt's form."""

    def piece(token: str) -> str:
        if token.startswith("[") and token.endswith("]"):
            return token
        if token.startswith(PHANTOM_SPACE):
            return token[len(PHANTOM_SPACE) :]
        return CONTINUATION + token

    return [piece(token) for token in tokens]


def _token_id(meta: dict[str, Any], *keys: str) -> int:
    for key in keys:
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None:
            return int(value)
    raise GgufError(f"the file has no tokenizer.ggml.{keys[0]} (a BERT vocabulary needs it)")


def special_ids(meta: dict[str, Any]) -> dict[str, int]:
    return {
        "cls": _token_id(meta, "cls_token_id", "bos_token_id"),
        "sep": _token_id(meta, "seperator_token_id", "eos_token_id"),
        "unk": _token_id(meta, "unknown_token_id"),
        "pad": int(meta.get("tokenizer.ggml.padding_token_id", 0)),
    }


def build_wordpiece(meta: dict[str, Any]) -> Tokenizer:
    tokens = bert_vocabulary(list(meta["tokenizer.ggml.tokens"]))
    ids = special_ids(meta)
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    tokenizer = Tokenizer(
        models.WordPiece(
            vocab=vocab,
            unk_token=tokens[ids["unk"]],
            continuing_subword_prefix=CONTINUATION,
            max_input_chars_per_word=1 << 30,  # llama.cpp has no word length limit
        )
    )
    tokenizer.normalizer = normalizers.Sequence(
        [
            normalizers.NFD(),
            normalizers.BertNormalizer(
                clean_text=True, handle_chinese_chars=True, strip_accents=True, lowercase=True
            ),
        ]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls, sep = tokens[ids["cls"]], tokens[ids["sep"]]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0",
        pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[(cls, ids["cls"]), (sep, ids["sep"])],
    )
    types = meta.get("tokenizer.ggml.token_type") or []
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False)
         for i, kind in enumerate(types) if kind == _CONTROL]
    )  # fmt: skip
    return tokenizer


def wordpiece_config(meta: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json for the folder (transformers' fast tokenizer)."""
    tokens = bert_vocabulary(list(meta["tokenizer.ggml.tokens"]))
    ids = special_ids(meta)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "cls_token": tokens[ids["cls"]],
        "sep_token": tokens[ids["sep"]],
        "unk_token": tokens[ids["unk"]],
        "pad_token": tokens[ids["pad"]],
        "clean_up_tokenization_spaces": False,
    }
    mask = meta.get("tokenizer.ggml.mask_token_id")
    if mask is not None:
        config["mask_token"] = tokens[int(mask)]
    return config
