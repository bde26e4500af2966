"""Thinking budgets: the tracker's states, the replay script's rewrite, and the MLX engine
forcing the close of the think block as the next tokens (real generation on the qwen3
demo model, alone and batched with unbudgeted rows)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pipeserve.engine.base import ThinkingLimit
from pipeserve.engine.sampling.thinking_budget import BudgetTracker, budgeted_script
from tests.engine.helpers import collect, job, reference_ids

START, END, NL = 100, 101, 7
LIMIT = ThinkingLimit(3, (START,), (END,), (END, NL))


def feed(tracker: BudgetTracker, tokens: list[int]) -> list[int | None]:
    return [tracker.after(t) for t in tokens]


def test_the_block_is_counted_from_its_start_marker_and_closed_when_spent() -> None:
    tracker = BudgetTracker(LIMIT)
    assert feed(tracker, [1, 2, START, 5, 6]) == [None] * 5  # outside, then 2 inside
    assert tracker.after(8) == END  # the 3rd token inside: the close is forced next
    assert tracker.after(END) == NL  # ... one token at a time
    assert tracker.after(NL) is None and tracker.done
    assert feed(tracker, [START, 1, 2, 3, 4]) == [None] * 5  # one block per answer


def test_a_block_the_model_closes_itself_ends_the_budget() -> None:
    tracker = BudgetTracker(dataclasses.replace(LIMIT, opened=True))
    assert feed(tracker, [1, END, 2, 3, 4, 5]) == [None] * 6 and tracker.done


def test_zero_budgets() -> None:
    zero = dataclasses.replace(LIMIT, budget=0)
    assert BudgetTracker(zero).after(START) == END  # closed right after it opens
    opened = BudgetTracker(dataclasses.replace(zero, opened=True))
    assert opened.start() == END and opened.after(END) == NL


def test_multi_token_markers() -> None:
    limit = ThinkingLimit(2, (START, 1), (END, 2), (END, 2, NL))
    tracker = BudgetTracker(limit)
    assert feed(tracker, [START, 9, START, 1, 5]) == [None] * 5
    assert tracker.spent == 1 and tracker.after(6) == END


def test_the_replay_script_is_rewritten_as_a_budgeted_model_writes_it() -> None:
    looping = [START, NL, *[5] * 50, END, NL, 40, 41]
    assert budgeted_script(looping, LIMIT) == [START, NL, 5, 5, END, NL, 40, 41]
    assert budgeted_script([START, 5, 5, END, 40], LIMIT) == [START, 5, 5, END, 40]  # in budget
    assert budgeted_script([START, *[5] * 9], LIMIT) == [START, 5, 5, 5, END, NL]  # never closes
    assert budgeted_script([40, 41], dataclasses.replace(LIMIT, budget=0, opened=True)) == [
        END,
        NL,
    ]


def test_the_engine_forces_the_close_and_the_answer_follows(
    mlx_runtime: Callable[[str], Any], demo_model: Callable[[str], tuple[Any, Any]]
) -> None:
    runtime = mlx_runtime("qwen3")
    model, tokenizer = demo_model("qwen3")
    hf = runtime.tokenizer

    def ids(text: str) -> list[int]:
        return list(hf.encode(text, add_special_tokens=False))

    prompt = ids(
        "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    close = tuple(ids("</think>\n\n"))
    limit = ThinkingLimit(5, tuple(ids("<think>")), tuple(ids("</think>")), close, opened=True)
    free = collect(runtime.engine.submit(job(prompt, 30))).ids
    assert close[0] not in free[:6]  # the random model does not close the block by itself
    budgeted_job = dataclasses.replace(job(prompt, 30), thinking=limit)
    budgeted = collect(runtime.engine.submit(budgeted_job)).ids
    assert budgeted[:5] == free[:5] and tuple(budgeted[5:7]) == close
    # the model read the forced close: the answer is its greedy continuation after it
    assert budgeted[7:] == reference_ids(model, tokenizer, prompt + budgeted[:7], 23)
    # batched with unbudgeted rows, every row gives what it gives alone
    others = [ids("Hi"), ids("1 2 3 4 5 6 7 8")]
    alone = [collect(runtime.engine.submit(job(p, 20))).ids for p in others]
    streams = [runtime.engine.submit(job(others[0], 20)), runtime.engine.submit(budgeted_job)]
    streams.append(runtime.engine.submit(job(others[1], 20)))
    together = [collect(s).ids for s in streams]
    assert together == [alone[0], budgeted, alone[1]]


def test_budgeted_rows_in_a_speculating_batch(demo_model_dir: Callable[[str], Any]) -> None:
    """Rows that speculate (prompt lookup on code) and a budgeted row in one batch: every
    row gives what it gives without speculation, and the budgeted row its forced close."""
    from tests.engine.speculative.test_verify import CODE, PROMPT_LOOKUP, Model, Row, run
    from tests.engine.speculative.test_verify import job as spec_job

    m = Model(demo_model_dir("qwen3"))
    code = m.ids(CODE)
    close = tuple(m.ids("</think>\n\n"))
    limit = ThinkingLimit(4, tuple(m.ids("<think>")), tuple(m.ids("</think>")), close, opened=True)

    def rows(predicted: list[int] | None = None) -> list[Row]:
        return [
            Row(spec_job(m, code, 24, prediction_token_ids=predicted)),  # proposals accepted
            Row(spec_job(m, code[2:], 24, thinking=limit)),
            Row(spec_job(m, code[4:], 24)),
        ]

    plain = run(m, rows(), None)
    speculated = run(m, rows(plain[0].ids), PROMPT_LOOKUP)
    assert [r.ids for r in speculated] == [r.ids for r in plain]
    assert tuple(plain[1].ids[4:6]) == close
    assert speculated[0].usage.accepted_tokens > 0 and speculated[1].usage.proposed_tokens == 0


def test_a_block_opened_by_the_first_token_is_closed_right_after_it(
    mlx_runtime: Callable[[str], Any],
) -> None:
    """The row's very first token opens the block (the start marker here is whatever
    token the model writes first) and the budget is 0: the close follows at once."""
    runtime = mlx_runtime("qwen3")
    hf = runtime.tokenizer
    prompt = list(hf.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"))
    free = collect(runtime.engine.submit(job(prompt, 12))).ids
    close = tuple(hf.encode("</think>\n\n", add_special_tokens=False))
    limit = ThinkingLimit(0, (free[0],), tuple(hf.encode("</think>")), close)
    got = collect(runtime.engine.submit(dataclasses.replace(job(prompt, 12), thinking=limit)))
    assert got.ids[0] == free[0] and tuple(got.ids[1:3]) == close
