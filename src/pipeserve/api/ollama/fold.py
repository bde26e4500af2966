"""The `stream: false` object: the fold of the objects ollama_chunks (encode.py) produces."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pipeserve.api.ollama.encode import ErrorChunk
from pipeserve.api.openai_common import cancelled_error
from pipeserve.context import RequestContext


def fold_chunks(chunks: Iterable[dict[str, Any]], ctx: RequestContext) -> dict[str, Any]:
    """The `stream: false` object: the streamed texts joined, the calls gathered, and
    the last object's counts."""
    content: list[str] = []
    thinking: list[str] = []
    calls: list[Any] = []
    logprobs: list[Any] | None = None
    for chunk in chunks:
        if isinstance(chunk, ErrorChunk):
            raise chunk.api_error
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
    if "message" in body:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = calls
        body["message"] = message
    else:
        body["response"] = text
        if thinking:
            body["thinking"] = thinking
    return body


__all__ = ["fold_chunks"]
