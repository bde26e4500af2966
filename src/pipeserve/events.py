"""The typed events that flow between pipeline stages.

Events are small frozen dataclasses with slots: one is created per generated token,
so they must be cheap. A stage passes through, unchanged and in order, every event it
does not handle.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, TypeAlias

FinishReason: TypeAlias = Literal["stop", "length", "tool_calls", "cancelled", "error"]


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token: str
    logprob: float
    token_id: int


@dataclass(frozen=True, slots=True)
class TokenText:
    """One generated token, decoded to text (text may be "" for a partial UTF-8 char)."""

    text: str
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class PromptReady:
    """The prompt was admitted by the engine: real token counts for usage headers."""

    prompt_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArgsDelta:
    """A fragment of the call's JSON arguments; fragments concatenate to the final text."""

    index: int
    fragment: str


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    """The call is complete; `arguments` is the whole (coerced) JSON object text."""

    index: int
    arguments: str


@dataclass(frozen=True, slots=True)
class Finish:
    """Generation ended. `stop_sequence` is set when a request stop string matched."""

    reason: FinishReason
    stop_sequence: str | None = None


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    # Speculative decoding: tokens proposed and accepted, and those of Chat's `prediction`.
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    """A fault after the response started; encoders turn it into an in-protocol error."""

    kind: str
    message: str


@dataclass(frozen=True, slots=True)
class KeepAlive:
    """Nothing happened for a while (queue wait, long prefill): lets encoders ping."""


def arguments_valid(text: str) -> bool:
    """Complete call arguments (ToolCallEnd): a JSON object, or nothing at all (`{}`)."""
    if not text.strip():
        return True
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


Event: TypeAlias = (
    TokenText
    | PromptReady
    | ContentDelta
    | ReasoningDelta
    | ToolCallStart
    | ToolCallArgsDelta
    | ToolCallEnd
    | Finish
    | Usage
    | ErrorEvent
    | KeepAlive
)

__all__ = [
    "arguments_valid",
    "ContentDelta",
    "ErrorEvent",
    "Event",
    "Finish",
    "FinishReason",
    "KeepAlive",
    "PromptReady",
    "ReasoningDelta",
    "TokenText",
    "ToolCallArgsDelta",
    "ToolCallEnd",
    "ToolCallStart",
    "TopLogprob",
    "Usage",
]
