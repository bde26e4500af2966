"""The generate stage on real engines (demo qwen3 with MLX, and replay)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import mlx_lm
import pytest

from pipeserve.engine.base import ModelRuntime
from pipeserve.engine.runtime import build_runtime
from pipeserve.errors import ApiError
from pipeserve.events import ContentDelta, TokenText
from pipeserve.request import GenerationRequest, Message, SamplingParams
from pipeserve.stages.base import BuildEnv, RequestContext
from pipeserve.stages.generate import GenerateParams, build_generate
from tests.engine.helpers import collect, entry, reference_ids

PREFILL = '<tool_call>\n{"name": "'


@pytest.fixture(scope="module")
def runtime(demo_model_dir) -> Iterator[ModelRuntime]:
    demo_model_dir("qwen3")
    built = build_runtime(entry("demo:qwen3"))
    yield built
    built.engine.close()


@pytest.fixture(scope="module")
def replay(demo_model_dir) -> Iterator[ModelRuntime]:
    demo_model_dir("qwen3")
    built = build_runtime(entry("demo:qwen3", engine="replay"))
    yield built
    built.engine.close()


def stage(runtime: ModelRuntime | None, **params):
    return build_generate(GenerateParams(**params), BuildEnv("m", "qwen3", runtime))


def context(runtime: ModelRuntime, max_tokens: int | None = 12, **fields) -> RequestContext:
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    ids = runtime.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    request = GenerationRequest(
        model="m", messages=[Message("user", "Tell me about the sea.")],
        sampling=SamplingParams(temperature=0.0), max_tokens=max_tokens,
    )  # fmt: skip
    for key, value in fields.items():
        setattr(request, key, value)
    return RequestContext(
        request=request, request_id="r", model_name="m", prompt_token_ids=list(ids)
    )


def run(generate, ctx: RequestContext, upstream=()):
    generate.prepare(ctx)
    return collect(generate(iter(upstream), ctx))


def test_greedy_through_stage_equals_mlx_lm(runtime, demo_model):
    model, tokenizer = demo_model("qwen3")
    ctx = context(runtime, max_tokens=20)
    got = run(stage(runtime), ctx)
    assert got.ids == reference_ids(model, tokenizer, ctx.prompt_token_ids, 20)
    expected_text = mlx_lm.generate(model, tokenizer, prompt=ctx.prompt_token_ids, max_tokens=20)
    assert got.text.lstrip(" ") == expected_text  # mlx-lm trims one leading space
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ctx.prompt_token_ids), 20)


def test_prefill_is_appended_not_reemitted(runtime, demo_model):
    model, tokenizer = demo_model("qwen3")
    ctx = context(runtime, max_tokens=8)
    ctx.assistant_prefill = PREFILL
    prompt = ctx.prompt_token_ids + list(tokenizer.encode(PREFILL, add_special_tokens=False))
    got = run(stage(runtime), ctx)
    assert got.ready.prompt_tokens == len(prompt)
    assert got.ids == reference_ids(model, tokenizer, prompt, 8)
    assert not got.text.startswith("<tool_call>")


def test_upstream_events_pass_first(runtime):
    marker = ContentDelta("upstream")
    ctx = context(runtime, max_tokens=2)
    generate = stage(runtime)
    generate.prepare(ctx)
    events = list(generate(iter([marker]), ctx))
    assert events[0] is marker
    collect(events[1:])


def test_context_length_is_checked(runtime):
    ctx = context(runtime)
    small = dataclasses.replace(runtime, context_length=len(ctx.prompt_token_ids))
    with pytest.raises(ApiError) as raised:
        stage(small).prepare(ctx)
    assert raised.value.kind == "invalid_request" and raised.value.param == "messages"
    assert f"context length is {len(ctx.prompt_token_ids)} tokens" in raised.value.message


def test_max_tokens_capped_by_context_room(runtime):
    ctx = context(runtime, max_tokens=100)
    roomy = dataclasses.replace(runtime, context_length=len(ctx.prompt_token_ids) + 3)
    got = run(stage(roomy), ctx)
    assert got.finish.reason == "length" and len(got.tokens) == 3


def test_default_max_tokens(runtime):
    ctx = context(runtime, max_tokens=None)
    got = run(stage(dataclasses.replace(runtime, default_max_tokens=5)), ctx)
    assert len(got.tokens) == 5


def test_mock_response_only_for_replay(runtime, replay):
    with pytest.raises(ApiError) as raised:
        stage(runtime).prepare(context(runtime, mock_response="hi"))
    assert raised.value.param == "mock_response"
    got = run(
        stage(replay), context(replay, max_tokens=100, mock_response="Hello <think>x</think> world")
    )
    assert got.text == "Hello <think>x</think> world"


def test_dry_run_does_not_submit(runtime):
    before = runtime.engine.stats()["requests_total"]
    ctx = context(runtime)
    ctx.dry_run = True
    generate = stage(runtime)
    generate.prepare(ctx)
    assert list(generate(iter(()), ctx)) == []
    assert runtime.engine.stats()["requests_total"] == before


def test_ctx_cancel_stops_generation(runtime):
    ctx = context(runtime, max_tokens=5000)
    generate = stage(runtime)
    generate.prepare(ctx)
    events = []
    for event in generate(iter(()), ctx):
        events.append(event)
        if isinstance(event, TokenText) and not ctx.cancelled:
            ctx.cancel("client_disconnected")
    got = collect(events)
    assert got.finish.reason == "cancelled"
    assert got.usage.completion_tokens == len(got.tokens) < 100


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 2.0),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
    ],
)
def test_bad_sampling_is_invalid_request(runtime, field, value):
    ctx = context(runtime)
    setattr(ctx.request.sampling, field, value)
    with pytest.raises(ApiError) as raised:
        stage(runtime).prepare(ctx)
    assert raised.value.kind == "invalid_request" and raised.value.param == field


@pytest.mark.parametrize("bias", [{10**9: 1.0}, {-1: 1.0}, {5: 250.0}])
def test_logit_bias_outside_the_vocabulary_or_range_is_invalid_request(runtime, bias):
    ctx = context(runtime)
    ctx.request.sampling.logit_bias = bias
    with pytest.raises(ApiError) as raised:
        stage(runtime).prepare(ctx)
    assert raised.value.kind == "invalid_request" and raised.value.param == "logit_bias"


def test_unloaded_model_is_unavailable(runtime):
    with pytest.raises(ApiError) as raised:
        stage(None).prepare(context(runtime))
    assert raised.value.kind == "unavailable"


def test_keepalive_param_reaches_stream(runtime):
    ctx = context(runtime, max_tokens=2)
    generate = stage(runtime, keepalive_interval=0.25)
    generate.prepare(ctx)
    assert ctx.generation.keepalive_interval == 0.25
    collect(generate(iter(()), ctx))
