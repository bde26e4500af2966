"""A lone prompt's last token in its last prefill chunk (engine/mlx/prompt_fold.py), on a
tiny random Gemma 3 with the CPU kernels' one-op layers (mixed quantizations, sliding
windows, as a Q4_K_M GGUF has them): the first token comes one engine step earlier, the
tokens are those of the unfolded steps (mlx-lm's flow over the same model), the prefix
cache still gets the prompt's snapshot without its last token, and what must not fold
(several prompts prefilled together, a prompt group, a prompt past a window) does not."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from pipeserve.config.models import EngineOptions, PrefixCacheOptions
from pipeserve.engine.mlx.generator import PrefillBatch
from pipeserve.engine.mlx.prompt_fold import folds, last_logits
from pipeserve.engine.mlx.scheduler import Scheduler
from pipeserve.engine.output.channel import Channel, Courier
from pipeserve.engine.output.detokenize import Detokenizers
from pipeserve.engine.output.request_state import RequestState
from tests.engine.cpu_kernels.test_gemma_layers import WINDOW, twins
from tests.engine.helpers import job

pytestmark = pytest.mark.mlx

PROMPTS = ([5, 17, 33, 2, 41, 9], [70, 3, 3, 12, 88, 40], [1, 2])  # shorter than the window


@pytest.fixture(scope="module")
def gemma(ext: Any) -> Any:
    return twins(ext)[1]


class Driver:
    """A Scheduler run step by step on the test thread, counting the folds."""

    def __init__(self, model: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        options = EngineOptions(max_batch=8, prefix_cache=PrefixCacheOptions(min_tokens=2))
        self.batch = Scheduler(model, options, {})
        self.courier, self.detokenizers = Courier(), Detokenizers(tokenizer)
        self.tokenizer = tokenizer
        self.folds: list[int] = []
        original = PrefillBatch._fold

        def counted(batch: Any, chunk: list[int], last: int) -> None:
            self.folds.append(len(chunk) + 1)
            original(batch, chunk, last)

        monkeypatch.setattr(PrefillBatch, "_fold", counted)

    def add(self, request: Any) -> RequestState:
        seq = RequestState(request, Channel(), self.detokenizers.new(), self.tokenizer)
        self.batch.add(id(seq), seq, self.courier)
        return seq

    def run(self) -> None:
        while self.batch.seqs:
            self.batch.step(self.courier)

    def events(self, seq: RequestState) -> list[Any]:
        self.courier.flush()
        out = []
        while (got := seq.channel.get(0)) is not None:
            out.extend(got)
        return out

    def ids(self, seq: RequestState) -> list[int]:
        return [e.token_id for e in self.events(seq) if hasattr(e, "token_id")]


def unfolded(model: Any, prompt: list[int], tokens: int) -> tuple[list[int], np.ndarray]:
    """mlx-lm's flow over the same model: the prompt but its last token prefilled, then
    one-token steps from the last prompt token (greedy ids, the first step's logits)."""
    cache = make_prompt_cache(model)
    model(mx.array([prompt[:-1]]), cache=cache)
    logits = model(mx.array([prompt[-1:]]), cache=cache)[:, -1]
    first = np.array(logits[0])
    ids = []
    for _ in range(tokens):
        token = mx.argmax(logits, axis=-1)
        ids.append(int(token.item()))
        logits = model(token[:, None], cache=cache)[:, -1]
    return ids, first


def test_gemma3_folds_and_its_last_logits_are_the_unfolded_steps(gemma: Any) -> None:
    assert folds(gemma)
    for prompt in PROMPTS:
        cache = make_prompt_cache(gemma)
        folded = np.array(last_logits(gemma, mx.array([prompt]), cache)[0])
        assert cache[0].offset == len(prompt)  # the cache took every prompt token
        _, reference = unfolded(gemma, prompt, 1)
        np.testing.assert_allclose(folded, reference, rtol=1e-4, atol=1e-4 * abs(reference).max())


def test_a_lone_prompt_folds_its_first_token_one_step_earlier(
    gemma: Any, demo_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver = Driver(gemma, demo_tokenizer("qwen3"), monkeypatch)
    for prompt in PROMPTS:
        seq = driver.add(job(prompt, max_tokens=12))
        driver.batch.step(driver.courier)  # the prompt and its last token: no token yet
        assert driver.folds[-1] == len(prompt) and driver.ids(seq) == []
        driver.batch.step(driver.courier)  # the first token (mlx-lm's flow: a step later)
        first = driver.ids(seq)
        assert len(first) == 1
        driver.run()
        assert first + driver.ids(seq) == unfolded(gemma, prompt, 12)[0]
    assert len(driver.folds) == len(PROMPTS)


def test_a_folded_prompt_keeps_its_snapshot_without_the_last_token(
    gemma: Any, demo_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver = Driver(gemma, demo_tokenizer("qwen3"), monkeypatch)
    prompt = PROMPTS[0]
    first = driver.add(job(prompt, max_tokens=10))
    for _ in range(3):  # the fold, the first token, the snapshot
        driver.batch.step(driver.courier)
    assert driver.batch.prefix.nbytes > 0  # the first request still runs: its snapshot
    again = driver.add(job(prompt, max_tokens=10))  # one token left to process
    driver.run()
    assert len(driver.folds) == 1  # a one-token rest has nothing to fold into
    assert driver.batch.stats["cached_tokens_total"] == len(prompt) - 1
    expected = unfolded(gemma, prompt, 10)[0]
    assert driver.ids(first) == driver.ids(again) == expected


def test_a_folded_logprobs_request_takes_mlx_lm_step_on_the_folded_logits(
    gemma: Any, demo_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver = Driver(gemma, demo_tokenizer("qwen3"), monkeypatch)
    wanting = job(PROMPTS[1], max_tokens=5)
    wanting.logprobs, wanting.top_logprobs = True, 2
    seq = driver.add(wanting)
    driver.run()
    tokens = [e for e in driver.events(seq) if hasattr(e, "token_id")]
    assert driver.folds == [len(PROMPTS[1])]
    assert [t.token_id for t in tokens] == unfolded(gemma, PROMPTS[1], 5)[0]
    _, logits = unfolded(gemma, PROMPTS[1], 1)
    expected = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    assert tokens[0].logprob == pytest.approx(float(expected.max()), abs=1e-3)
    assert all(len(t.top_logprobs) == 2 for t in tokens)


def test_prompts_prefilled_together_a_group_or_past_a_window_do_not_fold(
    gemma: Any, demo_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver = Driver(gemma, demo_tokenizer("qwen3"), monkeypatch)
    together = [driver.add(job(p, max_tokens=6)) for p in PROMPTS[:2]]
    driver.batch.step(driver.courier)
    grouped = job(PROMPTS[2] * 3, max_tokens=6)
    grouped.prompt_group = "n-choices"
    driver.run()
    long_prompt = list(range(3, 3 + WINDOW + 2))  # wraps the sliding layers' ring
    seqs = [driver.add(grouped), driver.add(job(long_prompt, max_tokens=6))]
    driver.run()
    assert driver.folds == []
    for prompt, seq in zip([*PROMPTS[:2], PROMPTS[2] * 3, long_prompt], [*together, *seqs]):
        assert driver.ids(seq) == unfolded(gemma, prompt, 6)[0]
