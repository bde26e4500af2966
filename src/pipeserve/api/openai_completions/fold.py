"""The non-streaming `text_completion`: the fold of the chunks CompletionEvents
(encode.py) produces, as a client joins a stream. An error chunk never reaches it: the
shared base raises its ApiError (api/framing.py `json_frames`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pipeserve.api.framing import Frame
from pipeserve.api.openai_common import cancelled_error
from pipeserve.context import RequestContext


def fold_completion(frames: Iterable[Frame], ctx: RequestContext) -> dict[str, Any]:
    """Accumulate the chunks into one `text_completion`, as a client joins a stream."""
    body: dict[str, Any] | None = None
    texts: list[str] = []
    logprobs: dict[str, list[Any]] | None = None
    finish: str | None = None
    for frame in frames:
        chunk = frame.data
        if not isinstance(chunk, dict):
            continue  # [DONE]
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
