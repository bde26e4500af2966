"""Legacy OpenAI Completions request body -> CompletionGenerationRequest.

Prompt in, text out: the prompt (a string, or token ids; a list of one of either) is
sent to the model as is, without the chat template, and the answer is the model's text
as generated (no reasoning or tool-call parsing; see stages/base.py Chain.used).
Streaming, `echo`, `logprobs` (0-5), `stop`, `seed` and the sampling fields are served.
`suffix` asks for fill-in-the-middle: the prompt is the text before the hole, the
answer the text between it and the suffix (render_template lays it out with the model's
FIM tokens; a model without them answers a 400 naming `suffix`).
`n` (1-128) choices are decoded together from one prefill, choice i with the seed
stream seed + i. Refused with a 400 naming the field, rather than silently ignored:
`best_of` above 1, several prompts in one request, `echo` together with `logprobs` (it asks for
the prompt tokens' logprobs, which this server does not compute) and `echo` with
`suffix`. `max_tokens` defaults to 16, as in OpenAI's API.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeserve.api.openai_chat.decode import stop_of
from pipeserve.api.openai_common import check, choices_of, unsupported, validate
from pipeserve.api.openai_completions.schema import CompletionRequestIn
from pipeserve.errors import invalid
from pipeserve.request import FillInMiddle, GenerationRequest, RawPrompt

DEFAULT_MAX_TOKENS = 16


@dataclass(slots=True)
class CompletionGenerationRequest(GenerationRequest):
    """GenerationRequest plus the Completions-only facts its encoder needs."""

    echo: bool = False
    include_usage: bool = False


def raw_prompt(value: Any, suffix: Any = None) -> RawPrompt:
    """A string, token ids, or a list holding exactly one of either; with a `suffix`,
    the prefix of a fill-in-the-middle request (which may be empty)."""
    fim = fill_in_middle(suffix)
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        check(value != "" or fim is not None, "prompt", "the prompt must not be empty")
        return RawPrompt(text=value, fim=fim)
    check(value is not None, "prompt")
    check(isinstance(value, list) and value != [], "prompt", "expected a string or token ids")
    if all(isinstance(v, str) or isinstance(v, list) for v in value):
        raise invalid("Only one prompt per request is supported; send one request each.", "prompt")
    ids = [v for v in value if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    check(len(ids) == len(value), "prompt", "token ids must be non-negative integers")
    return RawPrompt(token_ids=ids, fim=fim)


def fill_in_middle(suffix: Any) -> FillInMiddle | None:
    """`suffix` (a string; null, absent or "": an ordinary completion, as Ollama's
    templates treat an empty suffix)."""
    if suffix is None:
        return None
    check(isinstance(suffix, str), "suffix", "expected a string")
    if suffix == "":
        return None
    return FillInMiddle(suffix=suffix, param="suffix")


def refuse_unhonoured(req: CompletionRequestIn) -> None:
    if req.echo and req.suffix not in (None, ""):
        raise unsupported("echo", "with 'suffix' the prompt is laid out with FIM tokens")
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
        raw_prompt=raw_prompt(req.prompt, req.suffix),
        sampling=sampling,
        max_tokens=req.max_tokens or DEFAULT_MAX_TOKENS,
        stop=stop_of(req.stop),
        stream=bool(req.stream),
        logprobs=req.logprobs is not None,
        top_logprobs=req.logprobs or 0,
        mock_response=req.mock_response,
        echo=bool(req.echo),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        n=choices_of(req.n),
    )


__all__ = ["CompletionGenerationRequest", "decode_completion"]
