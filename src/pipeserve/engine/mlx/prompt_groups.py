"""Requests that share one prompt (a request's `n` choices): prefilled once.

The server submits a request's n choices as n jobs of one `prompt_group` (each with its
own sampler and seed stream). The first job to arrive leads: it is prefilled as usual.
The others wait until the leader's prompt, all but its last token, is in its KV cache
(the prompt response that ends that segment); each then joins with its own copy of
that cache and only the last prompt token to process, and the rows decode together.
Where there is nothing to share (a one-token prompt, a prefix-cache hit that leaves one
token, a sharded model) or the leader goes away first, the others are added as usual.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from pipeserve.engine.kv.prefix_cache import CacheLookup
from pipeserve.engine.output.request_state import RequestState


@dataclass
class PromptGroup:
    size: int  # jobs in the group
    leader: int  # the leader's request key
    prompt: list[int]
    open: bool  # the leader is prefilling: the others wait for its KV cache
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


__all__ = ["PromptGroup"]
