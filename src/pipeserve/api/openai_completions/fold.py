"""The non-streaming `text_completion`: the fold of the chunks completion_chunks
(encode.py) produces, as a client joins a stream."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pipeserve.api.openai_common import cancelled_error
from pipeserve.api.openai_completions.encode import KEEP_ALIVE
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError, ErrorKind

# An error chunk's OpenAI type -> the kind the non-stream answer is rendered from.
ERROR_KINDS: dict[str, ErrorKind] = {
    "invalid_request_error": "invalid_request",
    "timeout_error": "timeout",
    "rate_limit_error": "overloaded",
    "not_found_error": "not_found",
}


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


__all__ = ["fold_completion"]
