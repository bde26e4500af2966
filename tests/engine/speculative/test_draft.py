"""Speculative method draft: another model of the same tokenizer proposes, batched over
the rows; the output is exactly the target's own.

A Scheduler is driven step by step on the test thread with and without a draft: greedy
tokens are equal token for token at batch 1 and with several rows (two joining
mid-way, one of them whose prompt comes partly from the prefix cache, one cancelled,
one ending on a stop string, one with a wrong `prediction`; a seeded sampled row is
equal too). Drafts: the target's own weights loaded again (its twin,
whose proposals the target accepts), and a smaller random model of the same family and
tokenizer. A draft of another tokenizer is refused at load.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from pipeserve.config.models import EngineOptions, ModelEntry, SpeculativeOptions
from pipeserve.engine.base import GenerationJob
from pipeserve.engine.mlx.scheduler import Scheduler
from pipeserve.engine.output.channel import Channel, Courier
from pipeserve.engine.output.detokenize import Detokenizers
from pipeserve.engine.output.request_state import RequestState
from pipeserve.engine.runtime import build_runtime, start_engine
from pipeserve.engine.weights.demo.build import write_demo_model
from pipeserve.engine.weights.demo.families import QWEN3
from pipeserve.engine.weights.loader import eos_token_ids, load_model, load_tokenizer
from pipeserve.events import ErrorEvent, TokenText, Usage
from pipeserve.request import SamplingParams
from pipeserve.server.fleet import Fleet
from pipeserve.server.managed_engine import weights_bytes
from tests.engine.helpers import FreeVerification

pytestmark = pytest.mark.mlx

CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n" * 2
STOP = "return"
DRAFT = SpeculativeOptions(method="draft", draft="d", tokens=3, max_batch=8)
SMALL = dataclasses.replace(
    QWEN3,
    name="qwen3-small",
    seed=5,
    config={**QWEN3.config, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1},
)


@pytest.fixture(scope="module")
def target(demo_model_dir: Any) -> Path:
    return Path(demo_model_dir("qwen3"))


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory: pytest.TempPathFactory, pipeserve_home: Path) -> Path:
    """A smaller qwen3 with other random weights and the same tokenizer files."""
    folder = tmp_path_factory.mktemp("qwen3-small")
    write_demo_model(SMALL, folder, pipeserve_home / "cache")
    return folder


@dataclasses.dataclass
class Row:
    prompt: list[int]
    max_tokens: int = 20
    join_at: int = 0  # the step before which it is submitted
    cancel_at: int | None = None
    stop: tuple[str, ...] = ()
    sampling: dict[str, Any] = dataclasses.field(default_factory=lambda: {"temperature": 0.0})
    prediction: list[int] | None = None  # proposes first; the draft where it has nothing
    events: list[Any] = dataclasses.field(default_factory=list)
    steps: list[list[int]] = dataclasses.field(default_factory=list)  # token ids per step

    @property
    def ids(self) -> list[int]:
        return [e.token_id for e in self.events if isinstance(e, TokenText)]

    @property
    def usage(self) -> Usage:
        (usage,) = [e for e in self.events if isinstance(e, Usage)]
        return usage


def run(
    folder: Path, rows: list[Row], draft: Path | None, spec: SpeculativeOptions = DRAFT
) -> list[Row]:
    tokenizer = load_tokenizer(folder)
    options = EngineOptions(max_batch=8, speculative=spec if draft else None)
    batch = Scheduler(load_model(folder), options, {})
    if batch.speculation is not None:
        batch.speculation.costs = FreeVerification()  # verify all it can, on any machine
    if draft is not None:
        batch.use_draft(load_model(draft))
    eos, courier = eos_token_ids(tokenizer, folder), Courier()
    detokenizers = Detokenizers(tokenizer)
    seqs: dict[int, RequestState] = {}
    step = 0
    while step == 0 or batch.seqs or len(seqs) < len(rows):
        for key, row in enumerate(rows):
            if row.join_at == step:
                job = GenerationJob("t", row.prompt, SamplingParams(**row.sampling),
                                    row.max_tokens, eos, stop_strings=row.stop,
                                    prediction_token_ids=row.prediction if draft else None)  # fmt: skip
                seqs[key] = RequestState(job, Channel(), detokenizers.new(), tokenizer)
                batch.add(key, seqs[key], courier)
        if batch.seqs:
            batch.step(courier)
        step += 1
        for key, row in enumerate(rows):
            if row.cancel_at == step:
                batch.cancel(key, courier)
        courier.flush()
        for key, seq in seqs.items():
            new: list[Any] = []
            while (got := seq.channel.get(0)) is not None:
                new.extend(got)
            rows[key].events.extend(new)
            rows[key].steps.append([e.token_id for e in new if isinstance(e, TokenText)])
    return rows


def mixed(ids: list[int], stop: str) -> list[Row]:
    return [
        Row(ids),
        Row(ids[:9], max_tokens=14),
        Row(ids[4:], join_at=3),
        Row(ids + ids[:6], join_at=5),  # its prompt's start is in the prefix cache by then
        Row(ids[2:], cancel_at=4),
        Row(ids[1:], stop=(stop,)),
        Row(ids[3:], sampling={"temperature": 0.8, "seed": 11}),  # one draw per emitted token
        Row(ids[5:], prediction=ids[::-1]),  # a wrong prediction
    ]


def stop_string(target: Path, prompt: list[int]) -> str:
    """Text that the target's greedy answer to `prompt` completes at its 7th token."""
    answer = run(target, [Row(prompt)], None)[0].ids
    return str(load_tokenizer(target).decode(answer[5:7]))


def check_stop_row(tokenizer: Any, row: Row) -> None:
    """In the step whose tokens complete the stop string, none follows that token."""
    text = ""
    for step in row.steps:
        for position, token in enumerate(step):
            before, text = text, text + tokenizer.decode([token])
            if row.stop[0] in text and row.stop[0] not in before:
                assert position == len(step) - 1, (step, position)
                return
    raise AssertionError("the stop string never completed")


def check_equal(target: Path, draft: Path, rows: Any) -> tuple[int, int]:
    """Every row's tokens equal with and without the draft; (proposed, accepted) of the
    greedy rows."""
    plain = run(target, [dataclasses.replace(r, cancel_at=None) for r in rows()], None)
    drafted = run(target, rows(), draft)
    for index, (row, expected) in enumerate(zip(drafted, plain)):
        if row.cancel_at is None:
            assert row.ids == expected.ids, index
        else:
            assert row.ids == expected.ids[: len(row.ids)] and len(row.ids) < row.max_tokens
        if row.stop:
            check_stop_row(load_tokenizer(target), row)
    greedy = [r for r in drafted if r.sampling["temperature"] == 0]  # a twin's proposals fit
    return sum(r.usage.proposed_tokens for r in greedy), sum(
        r.usage.accepted_tokens for r in greedy
    )


def test_twin_draft_equal_and_accepted(target: Path) -> None:
    """The target's own weights as draft: the same output, nearly all proposals accepted."""
    ids = list(load_tokenizer(target).encode(CODE))
    proposed, accepted = check_equal(target, target, lambda: [Row(ids, max_tokens=24)])
    assert proposed > 0 and accepted >= 0.8 * proposed, (proposed, accepted)
    stop = stop_string(target, ids[1:])
    proposed, accepted = check_equal(target, target, lambda: mixed(ids, stop))
    assert proposed > 0 and accepted >= 0.8 * proposed, (proposed, accepted)


def test_twin_draft_follows_rows_that_fell_behind(target: Path) -> None:
    """Above max_batch nothing is drafted: when a third row joins for a while the two
    drafting rows fall behind, then catch up (about 10 tokens: fed in the first draft
    forward; about 30: prefilled again). The twin's proposals after that are still accepted, which
    they would not be were its cache out of step with the rows."""
    ids = list(load_tokenizer(target).encode(CODE))

    def rows() -> list[Row]:
        return [Row(ids, max_tokens=80), Row(ids[2:], max_tokens=80),
                Row(ids[4:], max_tokens=8, join_at=2), Row(ids[6:], max_tokens=24, join_at=14)]  # fmt: skip

    spec = DRAFT.model_copy(update={"max_batch": 2})
    plain = run(target, rows(), None)
    drafted = run(target, rows(), target, spec)
    assert [r.ids for r in drafted] == [r.ids for r in plain]
    for row in drafted[:2]:
        usage = row.usage
        assert usage.accepted_tokens >= 0.8 * usage.proposed_tokens > 0, usage


def test_smaller_draft_equal(target: Path, small_draft: Path) -> None:
    ids = list(load_tokenizer(target).encode(CODE))
    stop = stop_string(target, ids[1:])
    proposed, accepted = check_equal(target, small_draft, lambda: mixed(ids, stop))
    assert proposed >= accepted and proposed > 0


def entry(name: str, family: str, options: dict[str, Any], load: str = "startup") -> ModelEntry:
    return ModelEntry.model_validate(
        {"name": name, "source": f"demo:{family}", "pipeline": family, "options": options,
         "load": load}
    )  # fmt: skip


def job(prompt: list[int], max_tokens: int) -> GenerationJob:
    return GenerationJob("t", prompt, SamplingParams(temperature=0.0), max_tokens, frozenset())


def test_draft_of_another_tokenizer_leaves_the_model_unavailable(demo_model_dir: Any) -> None:
    """At load: the model is unavailable with the reason; another model keeps serving.
    (The fleet counts the draft's weights in the model's size.)"""
    demo_model_dir("qwen3"), demo_model_dir("kimi")
    fleet = Fleet()
    spec = {"speculative": {"method": "draft", "draft": "d"}, "warmup": False}
    target = entry("x", "qwen3", spec, load="on_demand")
    other = entry("y", "qwen3", {"warmup": False})
    draft = entry("d", "kimi", {})
    drafted = build_runtime(target, fleet.manager_for(target, draft), draft=draft)
    both = weights_bytes(demo_model_dir("qwen3")) + weights_bytes(demo_model_dir("kimi"))
    assert drafted.engine.size == both  # type: ignore[attr-defined]
    served = build_runtime(other, fleet.manager_for(other))
    fleet.set_current([drafted.engine, served.engine], [])  # type: ignore[list-item]
    prompt = list(drafted.tokenizer.encode("hi"))
    try:
        events = list(drafted.engine.submit(job(prompt, 4)))
        assert isinstance(events[-1], Usage) and events[-1].completion_tokens == 0
        (error,) = [e for e in events if isinstance(e, ErrorEvent)]
        assert "draft model 'd' does not share its tokenizer" in error.message, error
        answered = list(served.engine.submit(job(prompt, 4)))
        assert [e for e in answered if isinstance(e, Usage)][0].completion_tokens == 4
    finally:
        fleet.close()


def test_engine_loads_its_draft(target: Path) -> None:
    """Through start_engine: the draft loads on the engine thread and proposes."""
    tokenizer = load_tokenizer(target)
    spec = {"speculative": DRAFT.model_dump(), "warmup": False}
    engine = start_engine(entry("x", "qwen3", spec), target, tokenizer,
                          eos_token_ids(tokenizer, target), draft=entry("d", "qwen3", {}))  # fmt: skip
    try:
        ids = list(tokenizer.encode(CODE))
        events = list(engine.submit(job(ids, 12)))
    finally:
        engine.close()
    (usage,) = [e for e in events if isinstance(e, Usage)]
    assert usage.completion_tokens == 12 and usage.accepted_tokens > 0
    assert [e.token_id for e in events if isinstance(e, TokenText)] == run(
        target, [Row(ids, max_tokens=12)], None
    )[0].ids


def test_a_changed_draft_entry_reloads_the_model() -> None:
    from pipeserve.live_app import runtime_key

    spec = {"speculative": {"method": "draft", "draft": "d"}}
    target = entry("x", "qwen3", spec)
    keys = {runtime_key(target, [target, entry("d", family, {})]) for family in ("qwen3", "glm")}
    assert len(keys) == 2
    assert runtime_key(entry("y", "qwen3", {}), [target]) == runtime_key(entry("y", "qwen3", {}))
