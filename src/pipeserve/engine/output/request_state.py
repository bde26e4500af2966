"""Per-request state on the engine side and the events it produces.

Both engines (MLX and replay) drive a `RequestState`: it turns token ids into TokenText
events through a streaming detokenizer, counts usage and ends the stream with exactly
one Finish and one Usage (after an ErrorEvent on a fault).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from pipeserve.engine.base import GenerationJob
from pipeserve.engine.output.channel import Channel, Courier
from pipeserve.engine.output.detokenize import flush
from pipeserve.engine.speculative.proposer import RowProposer
from pipeserve.events import (
    ErrorEvent,
    Finish,
    FinishReason,
    PromptReady,
    TokenText,
    TopLogprob,
    Usage,
)

# token_id of the text a detokenizer still held when the stream ended (e.g. the bytes
# of an unfinished UTF-8 character before EOS): it belongs to no single new token.
FLUSH_TOKEN_ID = -1


class RequestState:
    def __init__(
        self, job: GenerationJob, channel: Channel, detokenizer: Any, tokenizer: Any
    ) -> None:
        self.job = job
        self.channel = channel
        self.detokenizer = detokenizer
        self.tokenizer = tokenizer
        self.prompt_tokens = len(job.prompt_token_ids)
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.finished = False
        self.started = False  # PromptReady sent
        self.last_token_id: int | None = None
        self.proposer: RowProposer | None = None  # set when the engine speculates for it
        self.submitted_at = time.monotonic()

    def ready(self, courier: Courier, cached_tokens: int = 0) -> None:
        if self.started:
            return
        self.started = True
        self.cached_tokens = cached_tokens
        courier.post(self.channel, PromptReady(self.prompt_tokens, cached_tokens))

    def token(
        self, courier: Courier, token_id: int, logprobs: Any = None, final: bool = False
    ) -> None:
        """Emit one generated token; `final` flushes the detokenizer (max tokens reached)."""
        self.ready(courier)
        self.completion_tokens += 1
        self.last_token_id = token_id
        if self.proposer is not None:
            self.proposer.emitted(token_id)
        self.detokenizer.add_token(token_id)
        text = flush(self.detokenizer) if final else self.detokenizer.last_segment
        logprob, tops = self._logprobs(token_id, logprobs)
        courier.post(self.channel, TokenText(text, token_id, logprob, tops))

    def stop_token(self, courier: Courier) -> None:
        """An EOS/stop token: counted, not emitted; flush what the detokenizer held."""
        self.ready(courier)
        self.completion_tokens += 1
        rest = flush(self.detokenizer)
        if rest:
            courier.post(self.channel, TokenText(rest, FLUSH_TOKEN_ID))

    def finish(self, courier: Courier, reason: FinishReason, error: str | None = None) -> None:
        if self.finished:
            return
        self.ready(courier, self.cached_tokens)
        self.finished = True
        if error is not None:
            courier.post(self.channel, ErrorEvent("internal", error))
        courier.post(self.channel, Finish(reason), self._usage())

    def _usage(self) -> Usage:
        usage = Usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)
        row = self.proposer
        if row is None:
            return usage
        return dataclasses.replace(
            usage,
            proposed_tokens=row.proposed,
            accepted_tokens=row.accepted,
            accepted_prediction_tokens=row.prediction_accepted,
            rejected_prediction_tokens=row.prediction_rejected,
        )

    def _logprobs(
        self, token_id: int, logprobs: Any
    ) -> tuple[float | None, tuple[TopLogprob, ...]]:
        if not self.job.logprobs or logprobs is None:
            return None, ()
        import mlx.core as mx

        logprob = logprobs[token_id].item()
        k = min(self.job.top_logprobs, logprobs.shape[-1])
        if k <= 0:
            return logprob, ()
        ids = mx.argpartition(-logprobs, kth=k - 1)[:k]
        values = logprobs[ids]
        order = mx.argsort(-values)
        ids_list = ids[order].tolist()
        values_list = values[order].tolist()
        tops = tuple(
            TopLogprob(self.tokenizer.decode([i]), float(v), int(i))
            for i, v in zip(ids_list, values_list)
        )
        return logprob, tops
