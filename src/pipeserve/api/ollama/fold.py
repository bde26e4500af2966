"""The `stream: false` object: the fold of the objects OllamaEvents (encode.py) produces.
An error object never reaches it: the shared base raises its ApiError (api/framing.py
`json_frames`), so the answer has the fault's status."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pipeserve.api.framing import Frame
from pipeserve.api.ollama.encode import answer_fields
from pipeserve.api.openai_common import cancelled_error
from pipeserve.context import RequestContext


def fold_chunks(frames: Iterable[Frame], ctx: RequestContext) -> dict[str, Any]:
    """The `stream: false` object: the streamed texts joined, the calls gathered, and
    the last object's counts."""
    content: list[str] = []
    thinking: list[str] = []
    calls: list[Any] = []
    logprobs: list[Any] | None = None
    for frame in frames:
        chunk = frame.data
        assert isinstance(chunk, dict), "Ollama's objects are all JSON objects"
        part = chunk.get("message", chunk)
        content.append(part.get("content", part.get("response", "")))
        thinking.append(part.get("thinking", ""))
        calls += part.get("tool_calls", [])
        if "logprobs" in chunk:
            logprobs = (logprobs or []) + chunk["logprobs"]
        if chunk["done"]:
            body = joined(chunk, "".join(content), "".join(thinking), calls)
            return body if logprobs is None else {**body, "logprobs": logprobs}
    raise cancelled_error(ctx)


def joined(last: dict[str, Any], text: str, thinking: str, calls: list[Any]) -> dict[str, Any]:
    body = dict(last)
    body.update(answer_fields("message" in body, text, thinking, calls))
    return body


__all__ = ["fold_chunks"]
