"""MlxEngine on the demo models: equality with mlx-lm, batching, seeds, usage, cancel."""

from __future__ import annotations

import itertools

import pytest

from pipeserve.engine.runtime import build_runtime
from pipeserve.errors import ApiError
from pipeserve.events import TokenText
from tests.engine.helpers import collect, entry, job, reference_ids

PROMPT = "<|im_start|>user\nTell me a story about a robot.<|im_end|>\n<|im_start|>assistant\n"


def encode(runtime, text: str) -> list[int]:
    return list(runtime.tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("family", ["qwen3", "glm", "gpt-oss", "kimi"])
def test_greedy_equals_mlx_lm(family, mlx_runtime, demo_model):
    runtime = mlx_runtime(family)
    model, tokenizer = demo_model(family)
    prompt = encode(runtime, "Hello there, how are you today?")
    got = collect(runtime.engine.submit(job(prompt, max_tokens=24, stop=runtime.eos_token_ids)))
    assert got.ids == reference_ids(model, tokenizer, prompt, 24)
    assert got.text == tokenizer.decode(got.ids)
    assert got.usage.prompt_tokens == len(prompt) == got.ready.prompt_tokens


def test_usage_counts_and_eos_is_counted_not_emitted(mlx_runtime):
    runtime = mlx_runtime("qwen3")
    prompt = encode(runtime, PROMPT)
    free = collect(runtime.engine.submit(job(prompt, max_tokens=10)))
    assert free.finish.reason == "length"
    assert (free.usage.prompt_tokens, free.usage.completion_tokens) == (len(prompt), 10)
    # Declare the 4th greedy token a stop token: 3 tokens are emitted, 4 are counted.
    stopped = collect(runtime.engine.submit(job(prompt, max_tokens=10, stop={free.ids[3]})))
    assert stopped.ids == free.ids[:3] and free.ids[3] not in free.ids[:3]
    assert stopped.finish.reason == "stop"
    assert stopped.usage.completion_tokens == 4


def test_seeds_reproduce_and_differ(mlx_runtime):
    runtime = mlx_runtime("qwen3")
    prompt = encode(runtime, PROMPT)

    def run(seed: int) -> list[int]:
        return collect(runtime.engine.submit(job(prompt, 24, temperature=1.0, seed=seed))).ids

    first, again, other = run(7), run(7), run(8)
    assert first == again
    assert first != other
    # Batched with other requests, a seed still gives the same tokens.
    streams = [runtime.engine.submit(job(prompt, 24, temperature=1.0, seed=s)) for s in (7, 8, 7)]
    results = [collect(s).ids for s in streams]
    assert results == [first, other, first]


def test_batched_greedy_equals_one_by_one(mlx_runtime):
    runtime = mlx_runtime("qwen3")
    prompts = [
        encode(runtime, text)
        for text in ("Hi", "Write a poem about the sea, please", PROMPT, "1 2 3 4 5 6 7 8")
    ]
    lengths = [30, 12, 25, 18]
    alone = [collect(runtime.engine.submit(job(p, n))).ids for p, n in zip(prompts, lengths)]
    streams = [runtime.engine.submit(job(p, n)) for p, n in zip(prompts[:3], lengths[:3])]
    first = iter(streams[0])
    head = [next(first) for _ in range(6)]  # the batch is decoding ...
    streams.append(runtime.engine.submit(job(prompts[3], lengths[3])))  # ... when the 4th joins
    results = [collect(head + list(first)).ids] + [collect(s).ids for s in streams[1:]]
    assert results == alone


def test_cancel_stops_within_one_step(mlx_runtime):
    runtime = mlx_runtime("qwen3")
    engine = runtime.engine
    stream = engine.submit(job(encode(runtime, PROMPT), max_tokens=5000))
    events = []
    for event in stream:
        events.append(event)
        if sum(isinstance(e, TokenText) for e in events) == 5:
            steps_at_cancel = engine.stats()["decode_steps"]
            stream.cancel()
            break
    events.extend(stream)
    got = collect(events)
    assert got.finish.reason == "cancelled"
    assert got.usage.completion_tokens == len(got.tokens) < 100
    assert engine.stats()["decode_steps"] - steps_at_cancel <= 1
    assert engine.stats()["active_sequences"] == 0 and engine.stats()["in_flight"] == 0


def test_abandoned_iteration_cancels(mlx_runtime):
    runtime = mlx_runtime("qwen3")
    engine = runtime.engine
    before = engine.stats()["requests_cancelled"]
    stream = engine.submit(job(encode(runtime, PROMPT), max_tokens=5000))
    iterator = iter(stream)
    next(iterator), next(iterator)
    iterator.close()  # what the HTTP layer does when the client goes away
    collect(engine.submit(job(encode(runtime, "ok"), max_tokens=2)))  # queued after the cancel
    assert engine.stats()["requests_cancelled"] == before + 1
    assert engine.stats()["in_flight"] == 0


def test_queue_full_is_overloaded(demo_model_dir):
    demo_model_dir("qwen3")
    runtime = build_runtime(entry("demo:qwen3", max_batch=1, queue_size=1))
    try:
        prompt = encode(runtime, PROMPT)
        streams = [runtime.engine.submit(job(prompt, max_tokens=5000)) for _ in range(2)]
        with pytest.raises(ApiError) as raised:
            runtime.engine.submit(job(prompt, max_tokens=5))
        assert raised.value.kind == "overloaded" and raised.value.retry_after
        second = iter(streams[1])
        ready = next(second)  # PromptReady: both are admitted
        stats = runtime.engine.stats()
        assert (stats["active_sequences"], stats["queue_depth"]) == (1, 1)
        for stream, events in (
            (streams[0], iter(streams[0])),
            (streams[1], itertools.chain([ready], second)),
        ):
            stream.cancel()
            assert collect(events).finish.reason == "cancelled"
        assert collect(runtime.engine.submit(job(prompt, max_tokens=3))).finish.reason == "length"
    finally:
        runtime.engine.close()


def test_prefix_cache_reuses_long_prompt(demo_model_dir):
    demo_model_dir("qwen3")
    runtime = build_runtime(entry("demo:qwen3"))
    try:
        prompt = encode(runtime, PROMPT * 20)
        first = collect(runtime.engine.submit(job(prompt, max_tokens=12)))
        second = collect(runtime.engine.submit(job(prompt, max_tokens=12)))
        assert first.ready.cached_tokens == first.usage.cached_tokens == 0
        assert second.ready.cached_tokens == second.usage.cached_tokens == len(prompt) - 1
        assert second.ids == first.ids
        # A longer conversation that starts with the first one reuses prompt + answer.
        longer = prompt + first.ids + encode(runtime, "<|im_end|>\n<|im_start|>user\nMore!")
        third = collect(runtime.engine.submit(job(longer, max_tokens=5)))
        assert third.usage.cached_tokens >= len(prompt) + len(first.ids) - 1
        stats = runtime.engine.stats()
        assert stats["prefix_cache_hits"] == 2 and stats["prefix_cache_bytes"] > 0
    finally:
        runtime.engine.close()


def test_logprobs(mlx_runtime):
    runtime = mlx_runtime("qwen3")
    request = job(encode(runtime, PROMPT), max_tokens=4)
    request.logprobs, request.top_logprobs = True, 3
    got = collect(runtime.engine.submit(request))
    for token in got.tokens:
        assert token.logprob is not None and token.logprob <= 0
        assert len(token.top_logprobs) == 3
        best = token.top_logprobs[0]
        assert best.token_id == token.token_id and best.logprob == pytest.approx(token.logprob)
        assert [t.logprob for t in token.top_logprobs] == sorted(
            (t.logprob for t in token.top_logprobs), reverse=True
        )


def test_invalid_sampling_is_rejected_by_the_engine(mlx_runtime):
    runtime = mlx_runtime("qwen3")
    prompt = encode(runtime, PROMPT)
    broken = collect(runtime.engine.submit(job(prompt, max_tokens=4, temperature=1.0, min_p=2.0)))
    assert broken.finish.reason == "error" and broken.errors
    assert (
        collect(runtime.engine.submit(job(prompt, max_tokens=4, temperature=1.0))).finish.reason
        == "length"
    )


def test_engine_fault_fails_the_batch_and_engine_survives(mlx_runtime, monkeypatch):
    """A fault inside a decode step (here: a sampler that raises, injected for seed
    666) fails the requests of that batch with ErrorEvent + Finish("error") + Usage."""
    import pipeserve.engine.mlx.scheduler as batching

    real = batching.make_sampler

    def faulty(params, vocab_size=None):
        if params.seed != 666:
            return real(params, vocab_size)

        def sampler(logprobs):
            raise RuntimeError("injected sampler fault")

        return sampler

    monkeypatch.setattr(batching, "make_sampler", faulty)
    runtime = mlx_runtime("qwen3")
    prompt = encode(runtime, PROMPT)
    faults = runtime.engine.stats()["engine_faults"]
    bystander = runtime.engine.submit(job(prompt, max_tokens=200))
    broken = collect(runtime.engine.submit(job(prompt, max_tokens=4, temperature=1.0, seed=666)))
    assert broken.finish.reason == "error" and "injected" in broken.errors[0].message
    assert collect(bystander).finish.reason in ("error", "length")
    assert runtime.engine.stats()["engine_faults"] == faults + 1
    monkeypatch.undo()
    after = collect(runtime.engine.submit(job(prompt, max_tokens=4, temperature=1.0)))
    assert after.finish.reason == "length" and len(after.tokens) == 4


def test_a_stuck_step_makes_the_engine_unhealthy_until_it_ends(demo_model_dir):
    """A step that runs past stall_seconds reports unhealthy with the reason; once it
    ends the engine is healthy again and the request completes."""
    import threading
    import time

    from pipeserve.config.models import EngineOptions
    from pipeserve.engine.mlx.engine import MlxEngine
    from pipeserve.engine.weights.loader import load_tokenizer

    folder = demo_model_dir("qwen3")
    release, entered = threading.Event(), threading.Event()

    class GatedModel:  # the real model; one forward pass waits until the test releases it
        def __init__(self, model) -> None:
            self.model = model
            self.gate = False

        def __call__(self, *args, **kwargs):
            if self.gate:
                self.gate = False
                entered.set()
                release.wait(30)
            return self.model(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.model, name)

    import mlx_lm

    model = GatedModel(mlx_lm.load(str(folder))[0])
    options = EngineOptions(stall_seconds=0.2, warmup=False)
    engine = MlxEngine("gated", lambda: model, load_tokenizer(folder), options)
    try:
        assert engine.healthy and engine.health_reason == ""
        model.gate = True
        stream = engine.submit(job([1, 2, 3, 4], max_tokens=4))
        assert entered.wait(30)
        time.sleep(0.5)
        assert not engine.healthy
        assert "engine step has been running for" in engine.health_reason
        release.set()
        assert len(collect(stream).ids) == 4
        assert engine.healthy and engine.health_reason == ""
    finally:
        release.set()
        engine.close()
