"""Streaming detokenization: spaces kept, UTF-8 split across tokens, specials as text."""

from __future__ import annotations

from pipeserve.engine.channel import Channel, Courier
from pipeserve.engine.detokenize import Detokenizers
from pipeserve.engine.sequence import FLUSH_TOKEN_ID, Sequence
from pipeserve.events import Finish, TokenText, Usage
from tests.engine.helpers import job


def stream_texts(tokenizer, ids: list[int], stop: bool = False) -> list[TokenText]:
    channel, courier = Channel(), Courier()
    seq = Sequence(job([1, 2]), channel, Detokenizers(tokenizer).new(), tokenizer)
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
