"""pipeserve's BatchGenerator: mlx-lm's, run one planned step at a time, with a leaner
decode step for the common case, speculation inside the step and KV rows moved by the
CPU kernels.

The scheduler hands each step a StepPlan (step_plan.py) through `step(plan)`.

mlx-lm normalises every step's logits into log-probabilities for the whole batch
(`logits - logsumexp(logits)`, batch x vocabulary) and splits them into one array per
sequence, whether or not anyone reads them. When every sequence in the batch samples
greedily with no logits processor and no request asked for logprobs, the next token is
the argmax of the logits, which is the argmax of the log-probabilities (the same
constant is subtracted from every entry of a row): this step skips the normalisation.
On MLX's CPU backend the logsumexp over 64 x 151k logits cost several times the
forward pass of a small model. Any other batch runs mlx-lm's own step unchanged.

A batch whose rows have proposers (engine/speculative/proposer.py) may instead take a speculative
step that verifies proposed tokens (engine/speculative/verify.py).

A lone prompt's last chunk may take its last token too (engine/mlx/prompt_fold.py: the
families whose forward allows it, rows the scheduler's `fold` predicate admits, a prompt
that does not wrap a sliding window's ring): the row then starts generating in that same
call, its first step sampling the chunk's last logits instead of running the model.

Built by subclassing (mlx-lm 0.32): the generator's empty generation batch, and every
batch a finished prefill turns into (from its first step on), are `DecodeBatch`; its
prompt batches are `PrefillBatch`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from pipeserve.engine.kv.rows import keep_rows, kernel_finalize, row_cache
from pipeserve.engine.mlx.lora import LoRARows
from pipeserve.engine.mlx.prompt_fold import ReplayLogits, folds, last_logits
from pipeserve.engine.mlx.step_plan import DEFAULT_PLAN, StepPlan
from pipeserve.engine.speculative.state import Speculation
from pipeserve.engine.speculative.verify import speculative_next

# mlx-lm's classes as untyped bases (their annotations do not describe their state).
_mlx_generate: Any = importlib.import_module("mlx_lm.generate")
MlxGenerationBatch: Any = _mlx_generate.GenerationBatch
MlxPromptBatch: Any = _mlx_generate.PromptProcessingBatch
MlxBatchGenerator: Any = _mlx_generate.BatchGenerator


class DecodeBatch(MlxGenerationBatch):
    # Set by the generator before each step, from its plan and its own state:
    logprobs_wanted = True
    speculation: Speculation | None = None
    cache_ops: Any = None  # the CPU kernels' extension (ext.cache_rows), or None
    lora: LoRARows | None = None  # the model's adapters: each forward pass's rows (lora.py)
    _closing = False  # this step's tokens end every row: no next forward pass
    # engine/kv/rows.py: the kept rows' KV buffers a filter left to compact (its op not
    # queued yet), and what must end first (the kept rows' next tokens: the step in
    # flight; the finished rows' extracts).
    _compacting: list[mx.array] = []
    _before_compacting: list[mx.array] = []
    # A folded prompt's logits (B, vocab): the first step (its __init__) samples them.
    _first_logits: mx.array | None = None

    def next(self) -> Any:
        spec = self.speculation
        if spec is None:
            return self._ordinary_next(self._ends_every_row())
        started = spec.step_begins()
        if spec.proposers:
            self._rows()
            self._compact()  # a verification is queued as it is built
            responses = speculative_next(self, spec)
            if responses is not None:
                return responses
        closing = self._ends_every_row()
        if closing:
            spec.untimed()  # no forward pass: not a step's cost
        else:
            spec.ordinary(len(self.uids), started)
        return self._ordinary_next(closing)

    def _ends_every_row(self) -> bool:
        """Every row reaches its max_tokens with the tokens this step hands out."""
        batch: Any = self  # mlx-lm's untyped state
        return bool(batch.uids) and all(
            done + 1 >= most for done, most in zip(batch._num_tokens, batch.max_tokens)
        )

    def _ordinary_next(self, closing: bool) -> Any:
        self._closing = closing
        try:
            return super().next()
        finally:
            self._closing = False

    def filter(self, keep: list[int]) -> None:
        """mlx-lm's filter, with the KV caches' rows kept by engine/kv/rows.py (no
        wait for the step in flight); the kept rows' next tokens are queued at once, so
        the next step waits for them alone, not for the whole step it launches."""
        batch: Any = self  # mlx-lm's untyped state
        caches, batch.prompt_cache = batch.prompt_cache, []  # mlx-lm's loop skips them
        try:
            super().filter(keep)
        finally:
            batch.prompt_cache = caches
        if not keep:
            caches.clear()
            self._compacting, self._before_compacting = [], []
            return
        self._compacting = keep_rows(caches, keep, self.cache_ops)
        if batch._next_tokens is not None:
            mx.async_eval(batch._next_tokens)
            self._before_compacting = [*self._before_compacting, batch._next_tokens]

    def extract_cache(self, idx: int) -> list[Any]:
        batch: Any = self  # mlx-lm's untyped state
        cache, made = row_cache(batch.prompt_cache, idx, self.cache_ops)
        self._before_compacting = [*self._before_compacting, *made]
        return cache

    def _compact(self) -> None:
        """Before this step's forward pass is queued (it may be built already: MLX decides
        donation when an op is queued): the kept rows' buffers compacted (in place once
        the step in flight and the extracts have released them) and done, so that the
        layer ops write into them rather than copy them (a pending op's outputs are held
        by its task until it runs). Every step calls it before queuing a forward pass."""
        if self._compacting:
            mx.eval(self._before_compacting)
            mx.eval(self._compacting)
        self._compacting, self._before_compacting = [], []

    def _lean(self) -> bool:
        if self.logprobs_wanted or any(self.logits_processors):
            return False
        fallback = self.fallback_sampler
        samplers = self.samplers or [None]
        return all((fallback if s is None else s) is greedy_sampler for s in samplers)

    def _rows(self) -> None:
        """The next forward pass's rows, for the adapters' wrappers (lora.py)."""
        if self.lora is not None:
            self.lora.use(self.uids)

    def _step(self) -> Any:
        if self._first_logits is not None:
            return self._replayed_step(self._first_logits)
        if self._closing:
            return self._last_tokens()
        self._rows()
        if not self._lean():
            self._compact()  # mlx-lm's step queues its forward pass as it builds it
            return super()._step()
        batch: Any = self  # mlx-lm's untyped state
        batch._current_tokens = inputs = batch._next_tokens
        batch._current_logprobs = batch._next_logprobs
        logits = batch.model(inputs[:, None], cache=batch.prompt_cache)[:, -1, :]
        batch._next_tokens = mx.argmax(logits, axis=-1)  # what greedy_sampler returns
        batch._next_logprobs = [None] * len(batch.uids)
        self._compact()  # built while the step in flight ran; queued once the rows moved
        mx.async_eval(batch._next_tokens)
        # Rows from a step of mlx-lm's own (a batch that just joined) are still arrays.
        mx.eval(inputs, [row for row in batch._current_logprobs if row is not None])
        tokens: list[int] = inputs.tolist()
        for history, token in zip(batch.tokens, tokens):
            history.append(token)
        return tokens, batch._current_logprobs

    def _replayed_step(self, logits: mx.array) -> Any:
        """The step with the model's output replaced by a folded prompt's logits (the
        rows' KV holds the input tokens already): sampled as any step's."""
        batch: Any = self  # mlx-lm's untyped state
        self._first_logits = None
        model, batch.model = batch.model, ReplayLogits(logits)
        try:
            return self._step()
        finally:
            batch.model = model

    def _last_tokens(self) -> Any:
        """The tokens that end every row, without the next forward pass a step launches
        (its tokens would be thrown away, and it would hold up the next request's
        prefill). Their keys and values are not computed, so `tokens` (what the KV cache
        holds, which a finished row's prefix-cache entry is keyed by) does not take them."""
        batch: Any = self  # mlx-lm's untyped state
        batch._current_tokens = inputs = batch._next_tokens
        batch._current_logprobs = batch._next_logprobs
        mx.eval(inputs, [row for row in batch._current_logprobs if row is not None])
        tokens: list[int] = inputs.tolist()
        return tokens, batch._current_logprobs


class PrefillBatch(MlxPromptBatch):
    logprobs_wanted = True  # set by the generator before each step, from its plan
    lora: LoRARows | None = None  # as DecodeBatch's
    owner: BatchGenerator | None = None  # set by the generator before each step
    cache_ops: Any = None  # as DecodeBatch's: the kernels' extension, which rolls its rows
    first_logits: mx.array | None = None  # a folded row's logits, for `generate`

    def prompt(self, tokens: list[list[int]]) -> Any:
        if self.lora is not None:
            self.lora.use(self.uids)
        last = None if self.owner is None else self.owner.fold_token(self, tokens)
        if last is not None:
            return self._fold(tokens[0], last)
        with kernel_finalize(self.prompt_cache, self.cache_ops):
            return super().prompt(tokens)

    def _fold(self, chunk: list[int], last: int) -> None:
        """The one row's last chunk and its last token through the model, the logits of
        that token kept for the row's first step (its KV cache holds every prompt token;
        `tokens` the chunk's, as mlx-lm's prompt leaves them: the first step adds the last)."""
        batch: Any = self  # mlx-lm's untyped state
        batch.tokens[0] += chunk
        logits = last_logits(batch.model, mx.array([[*chunk, last]]), batch.prompt_cache)
        mx.eval([c.state for c in batch.prompt_cache], logits)
        mx.clear_cache()
        assert self.owner is not None
        self.owner.folded[batch.uids[0]] = logits

    def generate(self, tokens: list[list[int]]) -> Any:
        """mlx-lm's `generate` (0.32), building a DecodeBatch instead of a
        GenerationBatch: its `__init__` takes the new sequences' first step, which is then
        lean too (mlx-lm's normalised the logits of the whole new batch: at a burst of 64
        that one step cost about what the burst's prefill did)."""
        prompt: Any = self  # mlx-lm's untyped state
        if any(len(t) > 1 for t in tokens):
            prompt.prompt([t[:-1] for t in tokens])
        batch: Any = DecodeBatch.__new__(DecodeBatch)
        batch.logprobs_wanted = self.logprobs_wanted
        batch._first_logits, self.first_logits = self.first_logits, None
        batch.lora = self.lora  # its __init__ takes the first step
        batch.__init__(
            prompt.model,
            prompt.uids,
            mx.array([t[-1] for t in tokens]),
            prompt.prompt_cache,
            prompt.tokens,
            prompt.samplers,
            prompt.fallback_sampler,
            prompt.logits_processors,
            prompt.stop_sequences,
            prompt.max_tokens,
        )
        prompt.uids, prompt.prompt_cache, prompt.tokens = [], [], []
        prompt.samplers, prompt.logits_processors, prompt.max_tokens = [], [], []
        return batch

    def _copy(self) -> Any:
        batch = super()._copy()
        batch.logprobs_wanted = self.logprobs_wanted  # split() hands out copies
        batch.lora = self.lora
        batch.cache_ops = self.cache_ops
        return batch


class BatchGenerator(MlxBatchGenerator):
    """mlx-lm's BatchGenerator whose decode step is DecodeBatch's, run by `step(plan)`.
    With a `speculation`, rows with proposers verify proposals in the decode step
    (engine/speculative/verify.py). `cache_ops`: the CPU kernels' extension, which moves
    the rows of a batch's KV caches when rows finish (engine/kv/rows.py), or None.
    `lora`: the model's adapters (lora.py), told each forward pass's rows; None without."""

    def __init__(self, *args: Any, speculation: Speculation | None = None,
                 cache_ops: Any = None, lora: LoRARows | None = None,
                 fold: Callable[[int], bool] | None = None, **kwargs: Any) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        self.plan = DEFAULT_PLAN
        self.speculation = speculation
        self.cache_ops = cache_ops
        self.lora = lora
        # Which rows' last prompt token may fold into their last chunk (prompt_fold.py);
        # None: none (the model's forward does not allow it, or the scheduler says so).
        self.fold = fold if folds(self.model) else None
        self.folded: dict[int, mx.array] = {}  # uid -> its folded logits, this call
        self.folded_uids: list[int] = []  # rows whose prompt folded in the last step
        self._generation_batch.__class__ = DecodeBatch
        self._prompt_batch.__class__ = PrefillBatch

    def step(self, plan: StepPlan) -> Any:
        """One step as planned: (prompt responses, generation responses), as `next()`."""
        self.plan = plan
        self.prefill_batch_size = plan.prefill_rows  # mlx-lm reads it in `_next`
        return self.next()

    def force_next(self, uid: int, token: int) -> bool:
        """Make `token` the next input of the decoding row `uid`, in place of the token
        its sampler drew (a thinking budget forces the close of the think block): the
        next step feeds it to the model and returns it as the row's token. False when the
        row is not decoding."""
        batch: Any = self._generation_batch  # mlx-lm's untyped state
        if uid not in batch.uids or batch._next_tokens is None:
            return False
        row = batch.uids.index(uid)
        upcoming = batch._next_tokens
        here = mx.arange(upcoming.shape[0]) == row
        batch._next_tokens = mx.where(here, mx.array(token, dtype=upcoming.dtype), upcoming)
        return True

    def fold_token(self, batch: PrefillBatch, tokens: list[list[int]]) -> int | None:
        """The last prompt token to fold into this prefill call, or None: one row alone,
        its last chunk (only its last token left), admitted by `fold`, and a prompt that
        stays inside every sliding window (so its snapshot without the last token can
        be trimmed out of the KV cache)."""
        prompt: Any = batch  # mlx-lm's untyped state
        if self.fold is None or len(prompt.uids) != 1 or len(self._currently_processing) != 1:
            return None
        segments = self._currently_processing[0][0]
        if len(segments) != 1 or len(segments[0]) != 1 or not self.fold(prompt.uids[0]):
            return None
        held = len(prompt.tokens[0]) + len(tokens[0]) + 1  # positions once folded
        if any(held >= c.max_size for c in prompt.prompt_cache if hasattr(c, "max_size")):
            return None
        last: int = segments[0][0]
        return last

    def _start_folded(self, responses: list[Any]) -> None:
        """A row whose last token folded in this call leaves the prompt batch and starts
        generating now, as mlx-lm's split at the next call's start would; its prompt
        response says so (end of prompt)."""
        self.folded_uids = list(self.folded)
        if not self.folded:
            return
        ((uid, logits),) = self.folded.items()
        self.folded.clear()
        segments, _, total = self._currently_processing.pop()
        # The whole (one-row) prompt batch goes: mlx-lm's split would deep-copy its KV
        # cache, dozens of copies queued ahead of the row's next step.
        generator: Any = self  # mlx-lm's untyped state
        part: Any = generator._prompt_batch
        generator._prompt_batch = part.empty(
            self.model, self.sampler, prefill_step_size=self.prefill_step_size
        )
        part.first_logits = logits
        self._generation_batch.extend(part.generate(segments))
        for response in responses:
            if response.uid == uid:
                response.end_of_prompt, response.progress = True, (total, total)

    def _make_batch(self, n: int) -> Any:
        batch = super()._make_batch(n)
        batch.__class__ = PrefillBatch
        return batch

    def _next(self) -> Any:
        self._generation_batch.logprobs_wanted = self.plan.logprobs
        self._generation_batch.speculation = self.speculation
        self._generation_batch.cache_ops = self.cache_ops
        self._generation_batch.lora = self._prompt_batch.lora = self.lora
        self._prompt_batch.logprobs_wanted = self.plan.logprobs
        self._prompt_batch.owner = self
        self._prompt_batch.cache_ops = self.cache_ops
        result = super()._next()
        self._start_folded(result[0])
        spec = self.speculation
        # A prompt's prefill ran in this call, or the batch is empty (idle until the next
        # request): the time until the next step is not the step's.
        if spec is not None and (
            result[0] or self._currently_processing or not len(self._generation_batch)
        ):
            spec.untimed()
        return result
