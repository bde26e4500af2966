"""Speculative decoding inside the batch gives exactly the model's own output.

A Scheduler is driven step by step on the test thread twice, with and without
`options.speculative` (prompt lookup), on every demo family and the shipped SmolLM2:
greedy tokens are equal token for token at batch 1 and in a batch of 8 mixed rows
(repetitive prompts that propose, short ones that mostly do not, a wrong `prediction`
and a right one,
a JSON-schema constrained row, a seeded sampled row, one cancelled mid-way, one with a
stop string after which nothing of its step is emitted). Sampled output keeps its
distribution (a proposal-favouring bug would show as a shifted frequency).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

from pipeserve.config.models import EngineOptions, SpeculativeOptions
from pipeserve.constraint import Envelope
from pipeserve.engine.base import GenerationJob
from pipeserve.engine.mlx.scheduler import Scheduler
from pipeserve.engine.output.channel import Channel, Courier
from pipeserve.engine.output.detokenize import Detokenizers
from pipeserve.engine.output.request_state import RequestState
from pipeserve.engine.sampling.grammar import GrammarCompiler
from pipeserve.engine.speculative.policy import StepCosts
from pipeserve.engine.speculative.proposer import RowProposer
from pipeserve.engine.weights.demo.build import DEMO_FAMILIES
from pipeserve.engine.weights.loader import eos_token_ids, load_model, load_tokenizer, read_config
from pipeserve.events import Finish, TokenText, Usage
from pipeserve.request import OutputFormat, SamplingParams
from pipeserve.stages.grammar_plan import response_grammar
from tests.engine.helpers import FreeVerification

pytestmark = pytest.mark.mlx

CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n" * 3
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
STOP = "return"
CANCEL_AFTER = 3  # steps
PROMPT_LOOKUP = SpeculativeOptions(
    method="prompt_lookup", tokens=4, prediction_tokens=4, max_batch=8
)


class Model:
    def __init__(self, folder: Path) -> None:
        self.model = load_model(folder, "auto", True)
        self.tokenizer = load_tokenizer(folder)
        self.eos = eos_token_ids(self.tokenizer, folder)
        vocab = read_config(folder).get("vocab_size")
        self.grammar = GrammarCompiler(self.tokenizer, vocab, self.eos)

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))


class Row:
    def __init__(self, job: GenerationJob, cancel_at: int | None = None) -> None:
        self.job, self.cancel_at = job, cancel_at
        self.steps: list[list[Any]] = []  # events per step

    @property
    def ids(self) -> list[int]:
        return [e.token_id for step in self.steps for e in step if isinstance(e, TokenText)]

    @property
    def text(self) -> str:
        return "".join(e.text for step in self.steps for e in step if isinstance(e, TokenText))

    @property
    def finish(self) -> str:
        (finish,) = [e.reason for step in self.steps for e in step if isinstance(e, Finish)]
        return finish

    @property
    def usage(self) -> Usage:
        (usage,) = [e for step in self.steps for e in step if isinstance(e, Usage)]
        return usage


def run(m: Model, rows: list[Row], speculative: SpeculativeOptions | None) -> list[Row]:
    batch = Scheduler(m.model, EngineOptions(max_batch=8, speculative=speculative), {})
    if batch.speculation is not None:
        batch.speculation.costs = FreeVerification()
    courier, detokenizers = Courier(), Detokenizers(m.tokenizer)
    seqs = []
    for key, row in enumerate(rows):
        row.steps = []
        if speculative is None:  # a prediction would propose even so
            row.job = dataclasses.replace(row.job, prediction_token_ids=None)
        seq = RequestState(row.job, Channel(), detokenizers.new(), m.tokenizer)
        batch.add(key, seq, courier)
        seqs.append(seq)
    step = 0
    while batch.seqs:
        batch.step(courier)
        step += 1
        for key, row in enumerate(rows):
            if row.cancel_at == step:
                batch.cancel(key, courier)
        courier.flush()
        for row, seq in zip(rows, seqs):
            row.steps.append(drain(seq.channel))
    return rows


def drain(channel: Channel) -> list[Any]:
    out: list[Any] = []
    while (got := channel.get(0)) is not None:
        out.extend(got)
    return out


def job(m: Model, prompt: list[int], max_tokens: int, **options: Any) -> GenerationJob:
    sampling = options.pop("sampling", {"temperature": 0.0})
    return GenerationJob("t", prompt, SamplingParams(**sampling), max_tokens, m.eos, **options)


def mixed_rows(m: Model, max_tokens: int, answer: list[int], code: list[int]) -> list[Row]:
    short = m.ids("Hello")
    constraint = m.grammar.constraint(
        response_grammar(m.grammar, OutputFormat("json_schema", SCHEMA), Envelope(), False)
    )
    return [
        Row(job(m, code, max_tokens)),
        Row(job(m, code[5:], max_tokens, prediction_token_ids=m.ids("print('nothing alike')"))),
        Row(job(m, short, max_tokens)),
        Row(job(m, code, max_tokens, prediction_token_ids=answer)),
        Row(job(m, code, max_tokens, constraint=constraint)),
        Row(job(m, code[3:], max_tokens, sampling={"temperature": 0.8, "seed": 11})),
        Row(job(m, code[7:], max_tokens), cancel_at=CANCEL_AFTER),
        Row(job(m, code[1:], max_tokens, stop_strings=(STOP,))),
    ]


def check_equal(m: Model, max_tokens: int, code: str = CODE) -> tuple[int, int]:
    """Batch 1 and 8 mixed rows equal with and without speculation; (proposed, accepted)."""
    ids = m.ids(code)
    alone = [Row(job(m, ids, max_tokens))]
    answer = run(m, alone, None)[0].ids
    assert run(m, alone, PROMPT_LOOKUP)[0].ids == answer
    plain = [row.ids for row in run(m, mixed_rows(m, max_tokens, answer, ids), None)]
    rows = run(m, mixed_rows(m, max_tokens, answer, ids), PROMPT_LOOKUP)
    for index, (row, expected) in enumerate(zip(rows, plain)):
        if row.cancel_at is None:
            assert row.ids == expected, index
        else:
            assert row.ids == expected[: len(row.ids)] and len(row.ids) < max_tokens
    if rows[4].finish == "stop":
        json.loads(rows[4].text)
    check_stop_row(m, rows[7])
    return sum(r.usage.proposed_tokens for r in rows), sum(r.usage.accepted_tokens for r in rows)


def check_stop_row(m: Model, row: Row) -> None:
    """In the step whose tokens complete the stop string, none follows that token."""
    text = ""
    for step in row.steps:
        ids = [e.token_id for e in step if isinstance(e, TokenText)]
        for position, token in enumerate(ids):
            before, text = text, text + m.tokenizer.decode([token])
            if STOP in text and STOP not in before:
                assert position == len(ids) - 1, (ids, position)
                return


@pytest.mark.parametrize("family", DEMO_FAMILIES)
def test_demo_families_equal_with_and_without_speculation(family: str, demo_model_dir: Any) -> None:
    m = Model(demo_model_dir(family))
    proposed, accepted = check_equal(m, max_tokens=24)
    # Sliding-window caches cannot roll back per row: such a model does not speculate.
    if all(type(c) is KVCache for c in make_prompt_cache(m.model)):
        assert accepted > 0 and proposed >= accepted
    else:
        assert proposed == 0


def test_smollm2_equal_with_and_without_speculation(smollm2: tuple[Path, Path]) -> None:
    """Shorter than the demo models' run: tests run on MLX's reference BLAS, where a
    135M float32 model is slow."""
    m = Model(smollm2[1])
    proposed, accepted = check_equal(m, max_tokens=12, code=CODE[: len(CODE) // 3])
    assert accepted > 0 and proposed >= accepted


def test_sampled_output_keeps_its_distribution(demo_model_dir: Any) -> None:
    """Top-3 sampling with a prediction of the greedy answer (which a verifier that
    favoured proposals would over-produce): how often each position is the greedy
    token agrees with and without speculation within 4.5 standard deviations."""
    m = Model(demo_model_dir("qwen3"))
    prompt, length, runs = m.ids(CODE), 6, 16
    greedy = run(m, [Row(job(m, prompt, length))], None)[0].ids
    sampling = {"temperature": 1.0, "top_k": 3}

    def frequencies(speculative: SpeculativeOptions | None) -> tuple[list[float], int]:
        hits, accepted = [0] * length, 0
        for _ in range(runs):
            rows = [Row(job(m, prompt, length, sampling=dict(sampling),
                            prediction_token_ids=greedy)) for _ in range(8)]  # fmt: skip
            for row in run(m, rows, speculative):
                hits = [h + (a == b) for h, a, b in zip(hits, row.ids, greedy)]
                accepted += row.usage.accepted_tokens
        return [h / (runs * 8) for h in hits], accepted

    with_spec, accepted = frequencies(PROMPT_LOOKUP)
    without, _ = frequencies(None)
    assert accepted > 0
    count = runs * 8
    for p, q in zip(with_spec, without):
        mean = (p + q) / 2
        sigma = math.sqrt(max(mean * (1 - mean), 1 / count) * 2 / count)
        assert abs(p - q) <= 4.5 * sigma, (with_spec, without)


LOOKUP_ONLY = SpeculativeOptions(method="prompt_lookup", tokens=3, tokens_max=7)
# A step's seconds by tokens per row at batch 1, as measured for SmolLM2 on 2 CPU cores
# (docs/speculative.md): fixed here so that the policy's choices do not depend on the
# test machine's speed.
CPU_COSTS = {1: 1.0, 2: 1.31, 4: 2.12, 8: 3.45}


class FixedCosts(StepCosts):
    """The engine's step timings are ignored: the policy sees `costs` (batch 1) only."""

    def __init__(self, costs: dict[int, float] = CPU_COSTS) -> None:
        super().__init__()
        for width, seconds in costs.items():
            super().record(1, width, seconds)
            super().record(1, width, seconds)  # (the first at W > 1 is a warm-up)

    def record(self, batch: int, width: int, seconds: float) -> None:
        pass


def verifications(
    m: Model,
    row_job: GenerationJob,
    speculative: SpeculativeOptions | None,
    costs: dict[int, float] = CPU_COSTS,
) -> tuple[list[tuple[int, int]], RowProposer]:
    """One row decoded alone under FixedCosts: (proposed, accepted) of each step, read
    from the row's own proposer (0 proposed: an ordinary step), and the proposer."""
    batch = Scheduler(m.model, EngineOptions(max_batch=8, speculative=speculative), {})
    assert batch.speculation is not None
    batch.speculation.costs = FixedCosts(costs)
    courier, detokenizers = Courier(), Detokenizers(m.tokenizer)
    seq = RequestState(row_job, Channel(), detokenizers.new(), m.tokenizer)
    batch.add(0, seq, courier)
    row = seq.proposer
    assert row is not None
    steps = []
    while batch.seqs:
        proposed, accepted = row.proposed, row.accepted
        batch.step(courier)
        courier.flush()
        steps.append((row.proposed - proposed, row.accepted - accepted))
    return steps, row


def test_cost_model_proposes_long_where_accepted_and_stops_where_refused(
    smollm2: tuple[Path, Path],
) -> None:
    """Code that repeats itself (prompt lookup proposes it right): the row verifies
    proposals longer than its first ones (`tokens`) and most steps emit several tokens.
    A prediction built to be wrong at every position (each pair of the answer's tokens
    followed by a token that never comes next): after its first refusals the row takes
    ordinary steps, verifying again only now and then as its estimate recovers."""
    m = Model(smollm2[1])
    code = m.ids(CODE)
    steps, row = verifications(m, job(m, code, 40), LOOKUP_ONLY)
    verifying = [(proposed, accepted) for proposed, accepted in steps if proposed]
    assert max(proposed for proposed, _ in verifying) > LOOKUP_ONLY.tokens, steps
    assert len(verifying) >= 10 and row.accepted >= 0.6 * row.proposed, steps
    answer = run(m, [Row(job(m, code, 40))], None)[0].ids
    wrong = m.ids(" nothing")[-1]
    trap = [t for a, b in zip(answer, answer[1:]) for t in (a, b, wrong)]
    steps, row = verifications(m, job(m, code, 40, prediction_token_ids=trap), None)
    verifying = [(proposed, accepted) for proposed, accepted in steps if proposed]
    assert verifying and len(verifying) <= len(steps) // 4, steps
    assert row.accepted * 4 <= row.proposed, steps


def test_a_new_row_is_not_checked_where_even_a_whole_acceptance_would_not_pay(
    smollm2: tuple[Path, Path],
) -> None:
    """Costs where W tokens per row take longer than W ordinary steps: no proposal can
    pay, so even a row whose acceptance is unknown never verifies (its first check would
    only slow the batch), and its answer is the ordinary one. With CPU_COSTS the same
    row verifies (the test above)."""
    m = Model(smollm2[1])
    code = m.ids(CODE)
    slow = {1: 1.0, 2: 2.5, 4: 5.0, 8: 10.0}
    steps, row = verifications(m, job(m, code, 24), LOOKUP_ONLY, slow)
    assert all(proposed == 0 for proposed, _ in steps), steps
    assert not row.acceptance.known
    steps, row = verifications(m, job(m, code, 24), LOOKUP_ONLY)
    assert any(proposed for proposed, _ in steps), steps
