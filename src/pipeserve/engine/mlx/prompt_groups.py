"""Requests that share one prompt (a request's `n` choices): prefilled once.

The server submits a request's n choices as n jobs of one `prompt_group` (each with its
own sampler and seed stream). The first job to arrive leads: it is prefilled as usual.
The others wait until the leader's prompt, all but its last token, is in its KV cache
(the prompt response that ends that segment); each then joins with its own copy of
that cache and only the last prompt token to process, and the rows decode together.
Where there is nothing to share (a one-token prompt, a prefix-cache hit that leaves one
token, a sharded model) or the leader goes away first, the others are added as usual.
Engine thread only.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeserve.engine.kv.prefix_cache import CacheLookup
from pipeserve.engine.output.request_state import RequestState

# insert(key, state, lookup, shared): the scheduler adds a job to the generator
Insert = Callable[[int, RequestState, CacheLookup, bool], None]
Fetch = Callable[[list[int], str | None], CacheLookup]  # the prefix cache's lookup (adapter)


@dataclass
class PromptGroup:
    size: int  # jobs in the group
    leader: int  # the leader's request key
    prompt: list[int]
    open: bool  # the leader is prefilling: the others wait for its KV cache
    adapter: str | None = None  # the group's LoRA adapter (its KV is that adapter's)
    arrived: int = 1
    cache: list[Any] | None = None  # the leader's KV of prompt[:-1], once prefilled
    waiting: list[tuple[int, RequestState]] = field(default_factory=list)

    def lookup(self) -> CacheLookup:
        """A private copy of the leader's prompt KV, the last prompt token to process."""
        assert self.cache is not None
        return CacheLookup(copy.deepcopy(self.cache), len(self.prompt) - 1, self.prompt[-1:])

    @property
    def complete(self) -> bool:
        """Every job arrived and none waits: the group (and its cache) can go."""
        return self.arrived >= self.size and not self.open and not self.waiting


class PromptGroups:
    """The scheduler's groups. `fetch` is the prefix cache's lookup; the methods that add
    jobs take the scheduler's `insert` (bound to the step's courier)."""

    def __init__(self, fetch: Fetch, shareable: bool) -> None:
        self.fetch = fetch
        self.shareable = shareable  # False on a sharded model (its ranks replay rank 0)
        self.groups: dict[str, PromptGroup] = {}
        self.held: dict[int, str] = {}  # waiting job's key -> its group

    def add(self, insert: Insert, key: int, seq: RequestState) -> None:
        job = seq.job
        group_id = job.prompt_group if job.group_size > 1 else None
        if group_id is None:
            insert(key, seq, self.fetch(job.prompt_token_ids, job.adapter), False)
            return
        group = self.groups.get(group_id)
        if group is None:  # the leader: prefilled as usual, its KV shared
            lookup = self.fetch(job.prompt_token_ids, job.adapter)
            shareable = self.shareable and len(lookup.rest) > 1
            prompt = list(job.prompt_token_ids)
            group = self.groups[group_id] = PromptGroup(
                job.group_size, key, prompt, shareable, job.adapter
            )
            insert(key, seq, lookup, False)
        else:
            group.arrived += 1
            self._join(insert, key, seq, group)
        if group.complete:
            del self.groups[group_id]

    def _join(self, insert: Insert, key: int, seq: RequestState, group: PromptGroup) -> None:
        """A job of a group that has a leader: its prompt KV copied, waiting for it, or
        (nothing to share) added as usual."""
        adapter = seq.job.adapter
        if seq.job.prompt_token_ids != group.prompt or adapter != group.adapter:
            insert(key, seq, self.fetch(seq.job.prompt_token_ids, adapter), False)
        elif group.cache is not None:
            insert(key, seq, group.lookup(), True)
        elif group.open:
            group.waiting.append((key, seq))
            self.held[key] = str(seq.job.prompt_group)
        else:
            insert(key, seq, self.fetch(group.prompt, adapter), False)

    def prompt_prefilled(
        self, insert: Insert, key: int, group_id: str | None, extract: Callable[[], Any]
    ) -> None:
        """Row `key` has its prompt (all but the last token) in its KV cache: where it
        leads an open group, each waiting job joins with a copy (`extract()`)."""
        group = self.groups.get(group_id) if group_id is not None else None
        if group_id is None or group is None or group.leader != key or not group.open:
            return
        group.cache, group.open = extract(), False
        self._release(insert, group_id, group)

    def _release(self, insert: Insert, group_id: str, group: PromptGroup) -> None:
        waiting, group.waiting = group.waiting, []
        for key, seq in waiting:
            self.held.pop(key, None)
            shared = group.cache is not None
            lookup = group.lookup() if shared else self.fetch(group.prompt, group.adapter)
            insert(key, seq, lookup, shared)
        if group.complete:
            self.groups.pop(group_id, None)

    def leader_gone(self, insert: Insert, key: int) -> None:
        """A leader that ends before its prompt was shared: the others are added as usual."""
        for group_id, group in list(self.groups.items()):
            if group.leader == key and group.open:
                group.open = False
                self._release(insert, group_id, group)

    def forget(self, key: int) -> None:
        """A finished leader frees its prompt KV; choices not submitted yet prefill alone."""
        for group_id, group in list(self.groups.items()):
            if group.leader == key and not group.open:
                del self.groups[group_id]

    def take_held(self, key: int) -> RequestState | None:
        """Remove a job that waits for its leader (cancelled); None when it does not."""
        group_id = self.held.pop(key, None)
        if group_id is None:
            return None
        group = self.groups[group_id]
        found = next((w for w in group.waiting if w[0] == key), None)
        if found is None:
            return None
        group.waiting.remove(found)
        return found[1]

    def drain(self) -> list[RequestState]:
        """Every waiting job, the groups forgotten (the engine fails or closes)."""
        states = [seq for group in self.groups.values() for _, seq in group.waiting]
        self.groups.clear()
        self.held.clear()
        return states


__all__ = ["PromptGroup", "PromptGroups"]
