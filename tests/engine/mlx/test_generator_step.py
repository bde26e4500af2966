"""The lean decode step: argmax of the logits when the whole batch is greedy without
logprobs; mlx-lm's own step as soon as one request needs more. Same tokens either way."""

from __future__ import annotations

import pytest

from pipeserve.config.models import EngineOptions
from pipeserve.engine.mlx.generator import DecodeBatch, MlxGenerationBatch
from pipeserve.engine.mlx.scheduler import Scheduler
from pipeserve.engine.output.channel import Channel, Courier
from pipeserve.engine.output.detokenize import Detokenizers
from pipeserve.engine.output.request_state import RequestState
from tests.engine.helpers import job, reference_ids

pytestmark = pytest.mark.mlx

TEXTS = ("Hi there", "Write a poem about the sea, please", "1 2 3 4 5 6 7 8")


class Driver:
    """A Scheduler run step by step on the test thread (it belongs to the thread that runs it)."""

    def __init__(self, model, tokenizer) -> None:
        self.batch = Scheduler(model, EngineOptions(max_batch=8), {})
        self.courier, self.detokenizers, self.tokenizer = (
            Courier(),
            Detokenizers(tokenizer),
            tokenizer,
        )
        self.seqs: list[RequestState] = []
        self.lean_steps = 0

    def add(self, request) -> RequestState:
        seq = RequestState(request, Channel(), self.detokenizers.new(), self.tokenizer)
        self.batch.add(len(self.seqs), seq, self.courier)
        self.seqs.append(seq)
        return seq

    def step(self) -> None:
        self.batch.step(self.courier)
        generation = self.batch.gen._generation_batch
        assert isinstance(generation, DecodeBatch)
        self.lean_steps += bool(len(generation) and generation._lean())

    def events(self, seq: RequestState) -> list:
        self.courier.flush()
        out = []
        while (got := seq.channel.get(0)) is not None:
            out.extend(got)
        return [e for e in out if hasattr(e, "token_id")]


def test_greedy_batch_takes_the_lean_step_and_matches_mlx_lm(demo_model) -> None:
    model, tokenizer = demo_model("qwen3")
    driver = Driver(model, tokenizer)
    prompts = [list(tokenizer.encode(t)) for t in TEXTS]
    seqs = [driver.add(job(p, max_tokens=10)) for p in prompts]
    while driver.batch.seqs:
        driver.step()
    assert driver.lean_steps >= 8
    for prompt, seq in zip(prompts, seqs):
        assert [e.token_id for e in driver.events(seq)] == reference_ids(
            model, tokenizer, prompt, 10
        )


def test_a_logprobs_request_switches_to_mlx_lm_step_and_back(demo_model) -> None:
    model, tokenizer = demo_model("qwen3")
    driver = Driver(model, tokenizer)
    prompts = [list(tokenizer.encode(t)) for t in TEXTS]
    greedy = driver.add(job(prompts[0], max_tokens=24))
    for _ in range(6):
        driver.step()
    lean_before = driver.lean_steps
    wanting = job(prompts[1], max_tokens=5)
    wanting.logprobs, wanting.top_logprobs = True, 2
    with_logprobs = driver.add(wanting)
    while with_logprobs in driver.batch.seqs.values():
        driver.step()
    assert driver.lean_steps == lean_before  # mlx-lm's step while logprobs are wanted
    tokens = driver.events(with_logprobs)
    assert len(tokens) == 5 and all(
        t.logprob is not None and len(t.top_logprobs) == 2 for t in tokens
    )
    assert [t.token_id for t in tokens] == reference_ids(model, tokenizer, prompts[1], 5)
    while driver.batch.seqs:
        driver.step()
    assert driver.lean_steps > lean_before  # lean again once it left
    ids = [e.token_id for e in driver.events(greedy)]
    assert ids == reference_ids(model, tokenizer, prompts[0], 24)


def test_a_greedy_batch_never_takes_mlx_lm_step_not_even_its_first(
    demo_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefilled batch's first step (taken while it becomes a generation batch) is lean
    too: mlx-lm's normalising step runs for no token of a greedy batch, also when a
    second wave of prompts joins a running one. Tokens stay mlx-lm's."""
    model, tokenizer = demo_model("qwen3")
    mlx_lm_steps = []
    original = MlxGenerationBatch._step

    def counted(self):  # the real step, counted
        mlx_lm_steps.append(len(self.uids))
        return original(self)

    monkeypatch.setattr(MlxGenerationBatch, "_step", counted)
    driver = Driver(model, tokenizer)
    prompts = [list(tokenizer.encode(t)) for t in TEXTS]
    first = [driver.add(job(p, max_tokens=8)) for p in prompts[:2]]
    driver.step()
    driver.step()
    late = driver.add(job(prompts[2], max_tokens=8))
    while driver.batch.seqs:
        driver.step()
    assert mlx_lm_steps == []
    for prompt, seq in zip(prompts, [*first, late]):
        ids = [e.token_id for e in driver.events(seq)]
        assert ids == reference_ids(model, tokenizer, prompt, 8)


def test_rows_ending_together_run_no_forward_pass_past_their_last_token(
    demo_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step that hands out every row's last token launches no next forward pass (its
    tokens would be thrown away): N tokens cost N decode passes. The finished rows'
    prefix-cache entries hold what their caches computed, so a conversation that goes on
    from an answer reuses all of it but the last token, with the same tokens."""
    model, tokenizer = demo_model("qwen3")
    decode_passes = []
    original = type(model).__call__

    def counted(self, inputs, *args, **kwargs):  # the real forward pass, counted
        if inputs.shape[1] == 1:
            decode_passes.append(inputs.shape[0])
        return original(self, inputs, *args, **kwargs)

    monkeypatch.setattr(type(model), "__call__", counted)
    driver = Driver(model, tokenizer)
    prompts = [list(tokenizer.encode(t)) for t in TEXTS]
    seqs = [driver.add(job(p, max_tokens=n)) for p, n in zip(prompts, (4, 12, 12))]
    while driver.batch.seqs:
        driver.step()
    assert len(decode_passes) == 12  # one per token of the longest rows, none past them
    answers = [[e.token_id for e in driver.events(seq)] for seq in seqs]
    assert answers == [reference_ids(model, tokenizer, p, n) for p, n in zip(prompts, (4, 12, 12))]
    follow_up = prompts[1] + answers[1] + list(tokenizer.encode(" And then?"))
    seq = driver.add(job(follow_up, max_tokens=6))
    assert seq.cached_tokens == len(prompts[1]) + len(answers[1]) - 1
    while driver.batch.seqs:
        driver.step()
    assert [e.token_id for e in driver.events(seq)] == reference_ids(model, tokenizer, follow_up, 6)
