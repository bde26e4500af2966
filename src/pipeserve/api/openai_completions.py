"""Legacy OpenAI Completions (`api: openai-completions`, conventionally /v1/completions).

Prompt in, text out: the prompt (a string, or token ids; a list of one of either) is
sent to the model as is, without the chat template, and the answer is the model's text
as generated (no reasoning or tool-call parsing; see stages/base.py Chain.used).
Streaming, `echo`, `logprobs` (0-5), `stop`, `seed` and the sampling fields are served.
Refused with a 400 naming the field, rather than silently ignored: `suffix`
(fill-in-the-middle), `n` / `best_of` above 1, several prompts in one request, and
`echo` together with `logprobs` (it asks for the prompt tokens' logprobs, which this
server does not compute). `max_tokens` defaults to 16, as in OpenAI's API.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import Field

from pipeserve.api.base import RequestMeta, WireProtocol, register_protocol
from pipeserve.api.openai_chat import OpenAISamplingIn, stop_of
from pipeserve.api.openai_common import (
    KEEPALIVE_FRAME,
    Lenient,
    cancelled_error,
    check,
    close_events,
    openai_error_body,
    unsupported,
    validate,
)
from pipeserve.api.openai_completions_encode import KEEP_ALIVE, completion_chunks
from pipeserve.api.sse import sse_event
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError, ErrorKind, invalid
from pipeserve.events import Event
from pipeserve.request import GenerationRequest, RawPrompt

DEFAULT_MAX_TOKENS = 16
# An error chunk's OpenAI type -> the kind the non-stream answer is rendered from.
ERROR_KINDS: dict[str, ErrorKind] = {
    "invalid_request_error": "invalid_request",
    "timeout_error": "timeout",
    "rate_limit_error": "overloaded",
    "not_found_error": "not_found",
}
MAX_LOGPROBS = 5


class StreamOptions(Lenient):
    include_usage: bool | None = None


class CompletionRequestIn(OpenAISamplingIn):
    model: str
    prompt: Any = None
    suffix: Any = None
    max_tokens: int | None = Field(None, ge=1)
    n: int | None = None
    best_of: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None
    stop: Any = None
    mock_response: str | None = None


@dataclass(slots=True)
class CompletionGenerationRequest(GenerationRequest):
    """GenerationRequest plus the Completions-only facts its encoder needs."""

    echo: bool = False
    include_usage: bool = False


def raw_prompt(value: Any) -> RawPrompt:
    """A string, token ids, or a list holding exactly one of either."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        check(value != "", "prompt", "the prompt must not be empty")
        return RawPrompt(text=value)
    check(value is not None, "prompt")
    check(isinstance(value, list) and value != [], "prompt", "expected a string or token ids")
    if all(isinstance(v, str) or isinstance(v, list) for v in value):
        raise invalid("Only one prompt per request is supported; send one request each.", "prompt")
    ids = [v for v in value if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    check(len(ids) == len(value), "prompt", "token ids must be non-negative integers")
    return RawPrompt(token_ids=ids)


def refuse_unhonoured(req: CompletionRequestIn) -> None:
    if req.suffix not in (None, ""):
        raise unsupported("suffix", "fill-in-the-middle (text after the completion) is not served")
    if req.n not in (None, 1):
        raise invalid("Only n=1 is supported.", "n")
    if req.best_of not in (None, 1):
        raise invalid("Only best_of=1 is supported.", "best_of")
    if req.echo and req.logprobs is not None:
        raise unsupported("echo", "with 'logprobs' it needs the prompt tokens' logprobs")


def decode_completion(body: Any) -> CompletionGenerationRequest:
    req = validate(CompletionRequestIn, body)
    refuse_unhonoured(req)
    sampling = req.sampling()
    return CompletionGenerationRequest(
        model=req.model,
        messages=[],
        raw_prompt=raw_prompt(req.prompt),
        sampling=sampling,
        max_tokens=req.max_tokens or DEFAULT_MAX_TOKENS,
        stop=stop_of(req.stop),
        stream=bool(req.stream),
        logprobs=req.logprobs is not None,
        top_logprobs=req.logprobs or 0,
        mock_response=req.mock_response,
        echo=bool(req.echo),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
    )


def fold_completion(chunks: Iterable[dict[str, Any]], ctx: RequestContext) -> dict[str, Any]:
    """Accumulate the chunks into one `text_completion`, as a client joins a stream."""
    body: dict[str, Any] | None = None
    texts: list[str] = []
    logprobs: dict[str, list[Any]] | None = None
    finish: str | None = None
    for chunk in chunks:
        if "error" in chunk:
            error = chunk["error"]
            raise ApiError(ERROR_KINDS.get(error["type"], "internal"), error["message"])
        if chunk is KEEP_ALIVE:
            continue
        body = body or {k: v for k, v in chunk.items() if k not in ("choices", "usage")}
        if "usage" in chunk:
            choice = {"text": "".join(texts), "index": 0, "logprobs": logprobs}
            return {
                **body,
                "choices": [{**choice, "finish_reason": finish}],
                "usage": chunk["usage"],
            }
        choice = chunk["choices"][0]
        texts.append(choice["text"])
        finish = choice["finish_reason"] or finish
        if choice["logprobs"] is not None:
            logprobs = logprobs or {key: [] for key in choice["logprobs"]}
            for key, values in choice["logprobs"].items():
                logprobs[key].extend(values)
    raise cancelled_error(ctx)


def echo_of(ctx: RequestContext) -> bool:
    request = ctx.request
    return isinstance(request, CompletionGenerationRequest) and request.echo


@register_protocol
class OpenAICompletions(WireProtocol):
    name: ClassVar[str] = "openai-completions"

    def decode(self, body: Any, meta: RequestMeta) -> GenerationRequest:
        return decode_completion(body)

    def encode_json(self, events: Iterator[Event], ctx: RequestContext) -> dict[str, Any]:
        try:
            return fold_completion(completion_chunks(events, ctx, echo_of(ctx)), ctx)
        finally:
            close_events(events)

    def encode_stream(self, events: Iterator[Event], ctx: RequestContext) -> Iterator[bytes]:
        request = ctx.request
        usage = isinstance(request, CompletionGenerationRequest) and request.include_usage
        try:
            for chunk in completion_chunks(events, ctx, echo_of(ctx)):
                if chunk is KEEP_ALIVE:
                    yield KEEPALIVE_FRAME
                elif "error" in chunk:
                    yield sse_event(chunk)
                    return
                elif "usage" not in chunk:
                    yield sse_event(chunk)
                elif usage:
                    yield sse_event(chunk)
            yield sse_event("[DONE]")
        finally:
            close_events(events)

    def error_body(self, error: ApiError) -> dict[str, Any]:
        body = openai_error_body(error)
        if body["error"]["param"] == "messages":  # render / context-length checks: the prompt
            body["error"]["param"] = "prompt"
        return body


__all__ = ["CompletionGenerationRequest", "OpenAICompletions", "decode_completion"]
