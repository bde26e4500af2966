"""The sequences waiting on an embedding engine, and the padded batches made of them.

Every input of every waiting request is one item. A batch starts at the oldest item
(so no request waits behind a stream of newer ones), takes the items whose lengths
are closest to it (little padding) while the padded size stays within the token
budget, and is laid out right-padded: ids, mask (1 = real token), segment ids. A
backbone that takes packed batches (the encoder kernel) has no padding: its batch is
the oldest items in arrival order while their real tokens stay within the budget, laid
end to end."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from pipeserve.engine.embedding.jobs import EmbedJob, EmbedResult, Sequence
from pipeserve.engine.embedding.mailbox import Mailbox

MAX_PADDING = 1.25  # padded tokens of a batch / its real tokens


@dataclass(eq=False)
class Pending:
    """One submitted job inside the engine: its mailbox and the results so far."""

    key: int
    job: EmbedJob
    mailbox: Mailbox
    result: EmbedResult = field(default_factory=EmbedResult)
    left: int = 0
    done: bool = False
    started: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        count = len(self.job.sequences)
        self.left = count
        self.result.tokens = self.job.tokens
        if self.job.mode == "embed":
            self.result.vectors = [np.zeros(0, np.float32)] * count
        else:
            self.result.scores = [0.0] * count


@dataclass(eq=False)
class Item:
    pending: Pending
    index: int  # the sequence's place in its job

    @property
    def seq(self) -> Sequence:
        return self.pending.job.sequences[self.index]


@dataclass
class Layout:
    ids: np.ndarray
    mask: np.ndarray
    types: np.ndarray
    lengths: np.ndarray


class WaitingPool:
    def __init__(self) -> None:
        self.items: list[Item] = []  # in arrival order
        self.jobs: dict[int, Pending] = {}

    @property
    def empty(self) -> bool:
        return not self.items

    def add(self, pending: Pending) -> None:
        self.jobs[pending.key] = pending
        self.items.extend(Item(pending, i) for i in range(len(pending.job.sequences)))

    def remove(self, key: int) -> Pending | None:
        pending = self.jobs.pop(key, None)
        if pending is not None:
            self.items = [item for item in self.items if item.pending is not pending]
        return pending

    def finished(self, pending: Pending) -> None:
        self.jobs.pop(pending.key, None)

    def all_jobs(self) -> Iterator[Pending]:
        yield from list(self.jobs.values())

    def next_batch(self, budget: int, padded: bool = True) -> list[Item]:
        """padded=False: the oldest items while their real tokens fit `budget` (at least one).
        Else up to `budget` padded tokens around the oldest item (at least that one), while
        padding adds at most MAX_PADDING over the real tokens (on a CPU every padded token
        costs as much as a real one)."""
        if not padded:
            return self._oldest(budget)
        anchor = len(self.items[0].seq.ids)
        order = sorted(
            range(len(self.items)), key=lambda i: (abs(len(self.items[i].seq.ids) - anchor), i)
        )
        chosen: list[int] = []
        longest = real = 0
        for i in order:
            size = len(self.items[i].seq.ids)
            width = (len(chosen) + 1) * max(longest, size)
            if chosen and (width > budget or width > MAX_PADDING * (real + size)):
                break
            chosen.append(i)
            longest, real = max(longest, size), real + size
        taken = set(chosen)
        batch = [self.items[i] for i in sorted(chosen)]
        self.items = [item for i, item in enumerate(self.items) if i not in taken]
        return batch

    def _oldest(self, budget: int) -> list[Item]:
        count = total = 0
        for item in self.items:
            total += len(item.seq.ids)
            if count and total > budget:
                break
            count += 1
        batch, self.items = self.items[:count], self.items[count:]
        return batch


def pack(batch: list[Item]) -> Layout:
    """A batch laid end to end: ids and types (sum of lengths,), mask all ones."""
    lengths = np.array([len(item.seq.ids) for item in batch], dtype=np.int32)
    ids = np.concatenate([np.asarray(item.seq.ids, dtype=np.int32) for item in batch])
    types = np.zeros_like(ids)
    start = 0
    for item, length in zip(batch, lengths, strict=True):
        if item.seq.types is not None:
            types[start : start + length] = item.seq.types
        start += length
    return Layout(ids, np.ones_like(ids), types, lengths)


def lay_out(batch: list[Item]) -> Layout:
    """Right-padded arrays of a batch (padding: id 0, mask 0)."""
    lengths = np.array([len(item.seq.ids) for item in batch], dtype=np.int32)
    width = int(lengths.max())
    ids = np.zeros((len(batch), width), dtype=np.int32)
    mask = np.zeros((len(batch), width), dtype=np.int32)
    types = np.zeros((len(batch), width), dtype=np.int32)
    for row, item in enumerate(batch):
        seq = item.seq
        ids[row, : len(seq.ids)] = seq.ids
        mask[row, : len(seq.ids)] = 1
        if seq.types is not None:
            types[row, : len(seq.types)] = seq.types
    return Layout(ids, mask, types, lengths)
