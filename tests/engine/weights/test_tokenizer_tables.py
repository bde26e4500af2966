"""The tokenizer's construction-only Python tables are released, and nothing changes (the
deepseek demo's tokenizer loads as transformers' Qwen2Tokenizer, which keeps them)."""

from __future__ import annotations

import gc

from transformers import AutoTokenizer

from pipeserve.engine.weights.loader import load_tokenizer
from pipeserve.engine.weights.tokenizer_tables import (
    read_after_init,
    release_construction_tables,
)

TEXTS = [
    "def f(x):\n    return x ** 2  # 平方 🙂",
    "  Ünïcödé   runs\t\tand <|im_start|> specials <|endoftext|>",
]


def test_the_served_tokenizer_drops_the_tables_and_encodes_as_transformers(demo_model_dir):
    folder = demo_model_dir("deepseek")
    served, reference = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert {"_vocab", "_merges"} <= set(vars(reference))  # what transformers keeps
    assert not {"_vocab", "_merges"} & set(vars(served._tokenizer))
    gc.collect()
    for text in TEXTS:
        ids = served.encode(text)
        assert ids == reference.encode(text)
        assert served.decode(ids) == reference.decode(ids)
    assert served.get_vocab() == reference.get_vocab()
    messages = [{"role": "user", "content": TEXTS[0]}]
    rendered = served.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == reference.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    detokenizer = served.detokenizer
    detokenizer.reset()
    for token in served.encode(TEXTS[0]):
        detokenizer.add_token(token)
    detokenizer.finalize()
    assert detokenizer.text == TEXTS[0]


def test_a_class_that_reads_a_table_later_keeps_it(demo_model_dir):
    reference = AutoTokenizer.from_pretrained(demo_model_dir("deepseek"))

    class ReadsVocab(type(reference)):  # type: ignore[misc]
        def size(self) -> int:
            return len(self._vocab)

    reference.__class__ = ReadsVocab
    assert read_after_init(ReadsVocab, "_vocab")
    assert not read_after_init(ReadsVocab, "_merges")
    assert release_construction_tables(reference) == ["_merges"]
    assert reference.size() > 1000
