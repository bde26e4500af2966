"""Per-model sampling defaults: the model entry's `sampling:`, else the model folder's
generation_config.json, fill what a request leaves unset; a request's own values win."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pipeserve.api.anthropic_messages.decode import decode_sampling
from pipeserve.api.anthropic_messages.schema import MessagesBody
from pipeserve.api.ollama.decode import decode_ollama
from pipeserve.api.openai_completions.decode import decode_completion
from pipeserve.config.models import EngineOptions, ModelEntry, SamplingDefaults
from pipeserve.engine.base import ModelRuntime
from pipeserve.engine.runtime import build_runtime
from pipeserve.engine.weights.loader import sampling_defaults
from pipeserve.request import GenerationRequest, Message, SamplingParams, sampling_params
from pipeserve.stages.base import BuildEnv, RequestContext
from pipeserve.stages.generate import GenerateParams, build_generate


def test_request_values_win_and_unset_ones_take_defaults() -> None:
    defaults = {"temperature": 0.2, "top_p": 0.9, "top_k": 40}
    params = sampling_params(temperature=0.7, top_p=None, top_k=None).with_defaults(defaults)
    assert (params.temperature, params.top_p, params.top_k) == (0.7, 0.9, 40)
    assert params.min_p == 0.0  # no default given: the protocol's own
    assert sampling_params(temperature=0).with_defaults(defaults).temperature == 0


def test_directly_built_params_are_used_as_given() -> None:
    assert SamplingParams(temperature=1.0).with_defaults({"temperature": 0.2}).temperature == 1.0


def test_anthropic_request_without_sampling_takes_the_defaults() -> None:
    body = MessagesBody.model_validate(
        {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    )
    params = decode_sampling(body).with_defaults({"temperature": 0.2, "top_p": 0.9})
    assert (params.temperature, params.top_p) == (0.2, 0.9)


@pytest.mark.parametrize(
    "decode",
    [
        lambda: decode_completion({"model": "m", "prompt": "hi"}),
        lambda: decode_ollama({"model": "m", "prompt": "hi"}, "generate"),
        lambda: decode_ollama(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "chat"
        ),
    ],
    ids=["completions", "ollama-generate", "ollama-chat"],
)
def test_completions_and_ollama_requests_without_sampling_take_the_defaults(
    decode: Callable[[], GenerationRequest],
) -> None:
    defaults = {"temperature": 0.0, "repetition_penalty": 1.1}
    params = decode().sampling.with_defaults(defaults)
    assert (params.temperature, params.repetition_penalty) == (0.0, 1.1)


def test_ollama_options_win_over_the_defaults() -> None:
    body = {"model": "m", "prompt": "hi", "options": {"temperature": 0.7, "repeat_penalty": 1.3}}
    params = decode_ollama(body, "generate").sampling.with_defaults(
        {"temperature": 0.0, "repetition_penalty": 1.1, "top_p": 0.9}
    )
    assert (params.temperature, params.repetition_penalty, params.top_p) == (0.7, 1.3, 0.9)


def test_config_over_generation_config(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "temperature": 0.6,
                "top_p": 0.95,
                "top_k": 20,
                "do_sample": True,
                "eos_token_id": 2,
                "max_length": 100,
            }
        )
    )
    assert sampling_defaults(tmp_path, {"top_p": 0.8}) == {
        "temperature": 0.6, "top_p": 0.8, "top_k": 20,
    }  # fmt: skip
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert sampling_defaults(tmp_path, {}) == {"temperature": 0.0}
    assert sampling_defaults(tmp_path / "none", {"min_p": 0.1}) == {"min_p": 0.1}


@pytest.fixture(scope="module")
def runtime(demo_model_dir) -> Iterator[ModelRuntime]:
    demo_model_dir("qwen3")
    entry = ModelEntry(
        name="m", source="demo:qwen3", pipeline="qwen3", engine="replay",
        sampling=SamplingDefaults(temperature=0.3, repetition_penalty=1.1),
        options=EngineOptions(),
    )  # fmt: skip
    built = build_runtime(entry)
    yield built
    built.engine.close()


def test_generate_stage_applies_the_model_defaults(runtime: ModelRuntime) -> None:
    assert runtime.sampling_defaults == {"temperature": 0.3, "repetition_penalty": 1.1}
    stage = build_generate(GenerateParams(), BuildEnv("m", "qwen3", runtime))
    request = GenerationRequest(
        model="m", messages=[Message("user", "hi")], sampling=sampling_params(top_p=0.5)
    )
    ctx = RequestContext(request=request, request_id="r", model_name="m",
                         prompt_token_ids=[1, 2, 3], dry_run=True)  # fmt: skip
    stage.prepare(ctx)
    sampling = ctx.request.sampling
    assert (sampling.temperature, sampling.top_p, sampling.repetition_penalty) == (0.3, 0.5, 1.1)
