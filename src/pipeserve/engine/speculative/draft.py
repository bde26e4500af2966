"""A draft model's proposals for the rows of the continuous batch (engine thread only).

`options.speculative: {method: draft, draft: <model>, tokens: K}`: another model of the
config with the same tokenizer proposes K tokens per row and decode step by greedy
decoding; engine/speculative/verify.py verifies them in the target's step, so the output stays
the target's own whatever the draft proposes.

The draft runs batched: one BatchKVCache (mlx-lm's, rows left-padded to one shared end)
holds every drafting row, and each decode step runs K forwards of the draft for all of
them together. The cache is kept in step with each row's sequence by content, not by
events: the draft remembers the tokens its cache holds per row and, before drafting,
compares them with the row's sequence (prompt, output and the token about to be
decoded). Whatever the target did meanwhile (accepted part of a proposal, emitted tokens
while drafting was paused or the batch too large to speculate, cut a step at a stop
string) shows as a common prefix: the rest is forgotten (rows roll right and trim, the
scheme verify.py uses for the target) and the missing tokens are fed, right-padded
to the longest catch-up, in the first draft forward. A row that joins is prefilled
alone with its whole prompt (a target prompt served partly from the prefix cache still
needs all of it here) and then merged in; rows that left the target's batch (finished,
cancelled, failed) are filtered out at the next draft step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from pipeserve.engine.kv.rows import trim_rows
from pipeserve.errors import LoadRefused

log = logging.getLogger("pipeserve.engine")

PREFILL_CHUNK = 512  # tokens per draft forward while a joining row's prompt is prefilled
CATCH_UP_LIMIT = 16  # a row further behind than this is prefilled again, alone


def tokenizer_mismatch(target: Any, draft: Any) -> str | None:
    """Why `draft`'s tokenizer cannot propose token ids for `target`'s (None: it can):
    the two must map every token to the same id."""
    target_vocab, draft_vocab = target.get_vocab(), draft.get_vocab()
    if len(target_vocab) != len(draft_vocab):
        return f"its vocabulary has {len(draft_vocab)} tokens, the target's {len(target_vocab)}"
    differing = sum(1 for token, index in target_vocab.items() if draft_vocab.get(token) != index)
    if differing:
        return f"{differing} tokens have other ids than in the target's vocabulary"
    return None


def check_draft(name: str, draft_name: str, target_tokenizer: Any, draft_tokenizer: Any) -> None:
    """Refuse to load `name` (LoadRefused: the model is unavailable with this reason)
    when its draft does not share its tokenizer."""
    reason = tokenizer_mismatch(target_tokenizer, draft_tokenizer)
    if reason is not None:
        raise LoadRefused(
            f"model {name}: draft model {draft_name!r} does not share its tokenizer: {reason}"
        )


def batch_cache(model: Any) -> list[Any]:
    """An empty one-row BatchKVCache per layer; LoadRefused for a model whose cache
    cannot roll back per row (sliding windows, recurrent state)."""
    layers = make_prompt_cache(model)
    if not all(type(layer) is KVCache for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers})
        raise LoadRefused(f"a draft model needs plain KV caches to roll back; it has {kinds}")
    return [BatchKVCache([0]) for _ in layers]


@dataclass(slots=True)
class DraftRow:
    uid: int
    tokens: list[int]  # what the draft's cache holds for this row


class DraftProposer:
    """The draft model and its batched cache, owned by one engine thread."""

    def __init__(self, model: Any, tokens: int, vocab_size: int | None = None) -> None:
        self.model = model
        self.tokens = tokens
        self.vocab_size = vocab_size  # the target's: a wider draft's extra ids are cut off
        batch_cache(model)  # refuses an unsuitable draft at load
        self.rows: list[DraftRow] = []
        self.cache: list[Any] | None = None

    def clear(self) -> None:
        self.rows, self.cache = [], None

    def propose(
        self, uids: list[int], histories: list[list[int]], wanted: list[bool]
    ) -> list[list[int]]:
        """`tokens` greedy draft tokens after each wanted row's history (its sequence so
        far, ending with the token about to be decoded); [] for the other rows."""
        live = {uid: i for i, uid in enumerate(uids)}
        self._keep(lambda row: row.uid in live and self._near(row, histories[live[row.uid]]))
        drafting = {row.uid for row in self.rows}
        for uid, history, want in zip(uids, histories, wanted):
            if want and uid not in drafting:
                self._join(uid, history[:-1])
        if not self.rows:
            return [[] for _ in uids]
        drafted = self._draft([histories[live[row.uid]] for row in self.rows])
        by_uid = {row.uid: self._known(tokens) for row, tokens in zip(self.rows, drafted)}
        return [by_uid.get(uid, []) if want else [] for uid, want in zip(uids, wanted)]

    def _known(self, proposal: list[int]) -> list[int]:
        """The proposal up to its first id that the target has no embedding for."""
        limit = self.vocab_size
        if limit is None:
            return proposal
        return next((proposal[:i] for i, t in enumerate(proposal) if t >= limit), proposal)

    def _near(self, row: DraftRow, history: list[int]) -> bool:
        return len(history) - _common_prefix(row.tokens, history[:-1]) <= CATCH_UP_LIMIT

    def _keep(self, keep: Any) -> None:
        indices = [i for i, row in enumerate(self.rows) if keep(row)]
        if len(indices) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in indices]
        if not indices:
            self.cache = None
        elif self.cache is not None:
            for layer in self.cache:
                layer.filter(mx.array(indices))

    def _join(self, uid: int, prompt: list[int]) -> None:
        """Prefill `prompt` alone into a fresh one-row cache and merge it in."""
        cache = batch_cache(self.model)
        for start in range(0, len(prompt), PREFILL_CHUNK):
            chunk = mx.array([prompt[start : start + PREFILL_CHUNK]], dtype=mx.uint32)
            self.model(chunk, cache=cache)
            mx.eval([layer.keys for layer in cache])
        if self.cache is None:
            self.cache = cache
        else:
            for mine, theirs in zip(self.cache, cache):
                mine.extend(theirs)
        self.rows.append(DraftRow(uid, list(prompt)))

    def _draft(self, histories: list[list[int]]) -> list[list[int]]:
        cache = self.cache
        assert cache is not None
        kept = [
            min(_common_prefix(row.tokens, h[:-1]), len(h) - 1)
            for row, h in zip(self.rows, histories)
        ]
        trim_rows(cache, [len(row.tokens) - k for row, k in zip(self.rows, kept)])
        needs = [len(h) - k for h, k in zip(histories, kept)]
        width = max(needs)
        feed = [h[k:] + [h[-1]] * (width - len(h) + k) for h, k in zip(histories, kept)]
        logits = self.model(mx.array(feed, dtype=mx.uint32), cache=cache)
        last = logits[mx.arange(len(feed)), mx.array(needs) - 1]
        trim_rows(cache, [width - n for n in needs])  # the right padding
        token = mx.argmax(last, axis=-1)
        drafted = [token]
        for _ in range(self.tokens - 1):
            logits = self.model(token[:, None].astype(mx.uint32), cache=cache)
            token = mx.argmax(logits[:, -1, :], axis=-1)
            drafted.append(token)
        columns: list[list[int]] = mx.stack(drafted, axis=1).tolist()
        for row, history, proposal in zip(self.rows, histories, columns):
            row.tokens = history + proposal[:-1]
        return columns


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share (slice comparisons run in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low
