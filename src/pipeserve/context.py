"""The per-request context shared along a chain, from decode to encode.

Protocol-neutral like events.py and request.py: the server creates it, stages fill in
what later stages and the encoders need, each fact in its own typed field (who writes
it is noted per field). Stages keep any other per-request state locally. See
docs/architecture.md for the request's path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pipeserve.constraint import Envelope, GrammarPlan
from pipeserve.events import Event, TokenText
from pipeserve.request import GenerationRequest


@dataclass(frozen=True)
class ThinkMarkers:
    """A family's think block as text: how the model opens it, how it closes it, and the
    text the engine writes to close it when a thinking budget is spent (the close and
    what the family puts before the answer)."""

    start: str
    end: str
    close: str


@dataclass
class RequestContext:
    """Per-request facts. Writers: server (first block), stages (named per field)."""

    request: GenerationRequest
    request_id: str
    model_name: str
    served_model: str = ""  # the served model's own name (model_name may be an alias)
    adapter: str | None = None  # the LoRA adapter the request names (None: the base model)
    dry_run: bool = False  # prepare only (count_tokens): never submit to the engine
    keepalive_interval: float | None = None  # server default for the KeepAlive interval
    choices: int = 1  # the request's n: its n contexts' jobs share one prefill (by request_id)
    prompt: str | None = None  # rendered prompt text (render stage)
    prompt_token_ids: list[int] | None = None  # tokenized prompt (render or generate)
    prompt_opened_thinking: bool = False  # the prompt ends inside an open think block
    # render stage: token ids that end this answer besides the model's EOS (FIM's pad
    # and file-separator tokens); generate adds them to the job's stop ids
    stop_token_ids: frozenset[int] = frozenset()
    think_close: str = ""  # thinking: text that leaves an open think block
    think_markers: ThinkMarkers | None = None  # thinking: the family's think block (budgets)
    assistant_prefill: str = ""  # text appended after the generation prompt (forced tool call)
    forced_call: str = ""  # tool_calls: the part of assistant_prefill that opens the call
    envelope: Envelope | None = None  # thinking / tool_calls: how reasoning and answer are framed
    grammar_plan: GrammarPlan | None = None  # tool_calls: a grammar to enforce (forced calls)
    generation: Iterable[Event] | None = None  # generate: the submitted job's events
    # generate, when request.logprobs: every sampled token in order; encoders pair them
    # with content chunks (api/openai_common.py LogprobCursor), since deltas carry none.
    logprob_records: list[TokenText] = field(default_factory=list)
    cancelled: bool = False
    cancel_reason: str | None = None
    _cancel_callbacks: list[Callable[[], None]] = field(default_factory=list)

    def on_cancel(self, callback: Callable[[], None]) -> None:
        """Run callback when the request is cancelled (immediately if it already was)."""
        if self.cancelled:
            callback()
        else:
            self._cancel_callbacks.append(callback)

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop generation for this request (client gone, stop sequence hit, timeout)."""
        if self.cancelled:
            return
        self.cancelled = True
        self.cancel_reason = reason
        callbacks, self._cancel_callbacks = self._cancel_callbacks, []
        for callback in callbacks:
            callback()


__all__ = ["RequestContext", "ThinkMarkers"]
