"""Streaming detokenization: spaces kept, UTF-8 split across tokens, specials as text;
a sentencepiece vocabulary streams exactly what one decode gives."""

from __future__ import annotations

from typing import Any

import pytest

from pipeserve.engine.output.channel import Channel, Courier
from pipeserve.engine.output.detokenize import Detokenizers
from pipeserve.engine.output.request_state import FLUSH_TOKEN_ID, RequestState
from pipeserve.engine.weights.gguf import ensure_converted
from pipeserve.engine.weights.loader import load_tokenizer
from pipeserve.events import Finish, TokenText, Usage
from tests.engine.helpers import job
from tests.engine.weights.gguf_fixtures import write_tiny_gguf


def stream_texts(tokenizer, ids: list[int], stop: bool = False) -> list[TokenText]:
    channel, courier = Channel(), Courier()
    seq = RequestState(job([1, 2]), channel, Detokenizers(tokenizer).new(), tokenizer)
    for token in ids:
        seq.token(courier, token)
    if stop:
        seq.stop_token(courier)
    seq.finish(courier, "stop")
    courier.flush()
    events = channel.get(0)
    assert isinstance(events[-2], Finish) and isinstance(events[-1], Usage)
    assert events[-1].completion_tokens == len(ids) + stop
    return [e for e in events if isinstance(e, TokenText)]


def test_leading_space_and_specials_kept(demo_tokenizer):
    tokenizer = demo_tokenizer("qwen3")
    text = " Hi <think>x</think>  there"
    ids = tokenizer.encode(text, add_special_tokens=False)
    tokens = stream_texts(tokenizer, ids)
    assert "".join(t.text for t in tokens) == text
    assert [t.token_id for t in tokens] == ids


def test_multibyte_character_completes_on_its_last_token(demo_tokenizer):
    tokenizer = demo_tokenizer("qwen3")
    ids = tokenizer.encode("a 🤖!", add_special_tokens=False)
    texts = [t.text for t in stream_texts(tokenizer, ids)]
    assert "".join(texts) == "a 🤖!"
    assert "" in texts and " 🤖" in texts  # held back, then whole


def test_incomplete_character_before_eos_is_flushed(demo_tokenizer):
    tokenizer = demo_tokenizer("qwen3")
    ids = tokenizer.encode(" 🤖", add_special_tokens=False)[:-1]  # cut inside the emoji
    tokens = stream_texts(tokenizer, ids, stop=True)
    assert [t.text for t in tokens[:-1]] == [""] * len(ids)
    assert tokens[-1].token_id == FLUSH_TOKEN_ID and tokens[-1].text.startswith(" \ufffd")


@pytest.fixture(scope="module")
def spm_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tokenizer of a tiny GGUF with a sentencepiece (llama) vocabulary."""
    folder = tmp_path_factory.mktemp("spm")
    gguf = write_tiny_gguf(folder / "spm.gguf", vocab="spm")
    return load_tokenizer(ensure_converted(gguf, folder / "home"))


@pytest.mark.parametrize(
    "pieces",
    [
        ["▁hello", "▁world"],  # the first word's space is the one the decoder strips
        ["▁", "▁hello", "▁world"],  # only one space is stripped, not one per token
        ["▁▁", "he", "llo", "<0x0A>", "▁the", "▁", "▁wor", "ld"],
        ["<0x0A>", "▁hello"],
        ["<0xE2>", "<0x96>", "<0x81>", "▁a"],  # "▁" spelled in bytes is not a space
        ["<0xE6>", "<0x97>", "<0xA5>", "本", "▁x"],
    ],
)
def test_sentencepiece_stream_equals_one_decode(spm_tokenizer: Any, pieces: list[str]) -> None:
    ids = spm_tokenizer.convert_tokens_to_ids(pieces)
    streamed = "".join(t.text for t in stream_texts(spm_tokenizer, ids))
    assert streamed == spm_tokenizer.decode(ids)


def test_sentencepiece_stream_of_encoded_text(spm_tokenizer: Any) -> None:
    for text in ["hello world", " hello  world", "the theater\n\n is 12 日本 é (x)"]:
        ids = spm_tokenizer.encode(text, add_special_tokens=False)
        assert "".join(t.text for t in stream_texts(spm_tokenizer, ids)) == text
