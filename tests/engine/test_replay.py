"""ReplayEngine: scripted completions through real tokenizers, token by token."""

from __future__ import annotations

import pytest

from pipeserve.engine.replay import ReplayEngine
from pipeserve.events import KeepAlive, TokenText
from tests.engine.helpers import collect, job

QWEN_SCRIPT = ' Hello 世界 🤖!  <think>plan: call f</think>\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
HARMONY_SCRIPT = (
    "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi ✓"
)
GLM_SCRIPT = "idea</think>\nSure.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Zürich</arg_value></tool_call>"
KIMI_SCRIPT = (
    " Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "東京"}<|tool_call_end|><|tool_calls_section_end|>'
)


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def per_token_texts(tokenizer, ids: list[int]) -> list[str]:
    """Each token's new text; a split multi-byte character shows on its last token."""
    texts, shown = [], ""
    for i in range(len(ids)):
        full = tokenizer.decode(ids[: i + 1])
        if full.endswith("\ufffd"):
            texts.append("")
            continue
        texts.append(full[len(shown) :])
        shown = full
    return texts


@pytest.mark.parametrize(
    ("family", "script"),
    [
        ("qwen3", QWEN_SCRIPT),
        ("gpt-oss", HARMONY_SCRIPT),
        ("glm", GLM_SCRIPT),
        ("kimi", KIMI_SCRIPT),
    ],
)
def test_replay_reproduces_script_token_by_token(family, script, replay_runtime):
    runtime = replay_runtime(family)
    tokenizer = runtime.tokenizer
    request = job([1, 2, 3], max_tokens=1000)
    request.mock_completion = script
    got = collect(runtime.engine.submit(request))
    expected = encode(tokenizer, script)
    assert got.ids == expected
    assert got.text == script
    assert [t.text for t in got.tokens] == per_token_texts(tokenizer, expected)
    assert got.finish.reason == "stop"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (3, len(expected))


def test_special_tokens_stay_single_tokens(replay_runtime):
    tokenizer = replay_runtime("gpt-oss").tokenizer
    ids = encode(tokenizer, "<|channel|>final<|message|>")
    assert tokenizer.convert_ids_to_tokens([ids[0], ids[-1]]) == ["<|channel|>", "<|message|>"]
    qwen = replay_runtime("qwen3").tokenizer
    (think,) = encode(qwen, "<think>")
    assert qwen.convert_ids_to_tokens(think) == "<think>"


def test_eos_in_script_stops_and_is_counted(replay_runtime):
    runtime = replay_runtime("qwen3")
    request = job([1], max_tokens=100)
    request.mock_completion = "Done.<|im_end|>never streamed"
    got = collect(runtime.engine.submit(request))
    assert got.text == "Done."
    assert got.finish.reason == "stop"
    assert got.usage.completion_tokens == len(encode(runtime.tokenizer, "Done.")) + 1


def test_max_tokens_is_length(replay_runtime):
    runtime = replay_runtime("qwen3")
    request = job([1], max_tokens=3)
    request.mock_completion = "one two three four five"
    got = collect(runtime.engine.submit(request))
    assert got.ids == encode(runtime.tokenizer, "one two three four five")[:3]
    assert got.finish.reason == "length" and got.usage.completion_tokens == 3


def test_default_completion_and_empty_script(replay_runtime):
    runtime = replay_runtime("qwen3")
    engine = ReplayEngine(
        "r", runtime.tokenizer, runtime.eos_token_ids, default_completion="from yaml"
    )
    try:
        assert collect(engine.submit(job([1]))).text == "from yaml"
        empty = job([1])
        empty.mock_completion = ""
        got = collect(engine.submit(empty))
        assert got.tokens == [] and got.finish.reason == "stop" and got.usage.completion_tokens == 0
    finally:
        engine.close()


def test_cancel_with_delay(replay_runtime):
    runtime = replay_runtime("qwen3")
    engine = ReplayEngine(
        "r", runtime.tokenizer, runtime.eos_token_ids, default_completion="word " * 500, delay=0.01
    )
    try:
        stream = engine.submit(job([1], max_tokens=1000))
        events = []
        for event in stream:
            events.append(event)
            if sum(isinstance(e, TokenText) for e in events) == 3:
                stream.cancel()
                break
        got = collect(events + list(stream))
        assert got.finish.reason == "cancelled"
        assert got.usage.completion_tokens == len(got.tokens) < 50
        assert engine.stats()["active_sequences"] == 0
    finally:
        engine.close()


def test_keepalive_while_waiting(replay_runtime):
    runtime = replay_runtime("qwen3")
    engine = ReplayEngine(
        "r", runtime.tokenizer, runtime.eos_token_ids, default_completion="a b", delay=0.3
    )
    try:
        stream = engine.submit(job([1], max_tokens=10))
        stream.keepalive_interval = 0.05
        events = list(stream)
        assert any(isinstance(e, KeepAlive) for e in events)
        assert collect(events).text == "a b"
    finally:
        engine.close()
