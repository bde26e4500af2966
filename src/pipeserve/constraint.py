"""Protocol-neutral facts for structured output, shared by stages, context and engine.

Stages describe how their family frames reasoning and the answer (Envelope) or hand
the generate stage a grammar to enforce (GrammarPlan, e.g. a forced tool call);
stages/grammar_plan.py turns them into an llguidance grammar, engine/sampling/grammar.py
compiles it and engine/sampling/constraints.py enforces it while decoding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class Tokens(Protocol):
    """What grammar building needs from the model's tokenizer (GrammarCompiler)."""

    def encode(self, text: str) -> list[int]: ...

    def is_special(self, token_id: int) -> bool: ...

    def decode_bytes(self, ids: list[int]) -> bytes: ...


@dataclass(frozen=True, slots=True)
class Envelope:
    """How a family frames reasoning and the answer, as marker text (pipeline data).

    A reasoning block is `reasoning_open` free-text `reasoning_close`; `repeat` allows
    several (Harmony messages). The answer sits between `answer_open` and `answer_close`.
    """

    reasoning_open: str = ""
    reasoning_close: str = ""
    answer_open: str = ""
    answer_close: str = ""
    repeat: bool = False


@dataclass(frozen=True, slots=True)
class GrammarPlan:
    """A grammar a stage asks the generate stage to enforce (built off the hub).

    build: the llguidance grammar JSON for the model's tokenizer; forced: assistant
    prefill text the grammar starts with (fed to the matcher before decoding); param:
    the request field a compile error names; optional: the request is still right when
    an engine cannot enforce it (the prefill alone forces the call, as before grammars).
    """

    build: Callable[[Tokens], str]
    forced: str = ""
    param: str = "tool_choice"
    optional: bool = False


__all__ = ["Envelope", "GrammarPlan", "Tokens"]
