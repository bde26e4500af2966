"""The `chat.completion` body: the fold of the chunks ChatEvents (encode.py) produces,
as a client accumulating the stream ends up with it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pipeserve.api.framing import Frame
from pipeserve.api.openai_chat.encode import SERVICE_TIER, SYSTEM_FINGERPRINT
from pipeserve.context import RequestContext


@dataclass
class _Folded:
    content: str = ""
    reasoning: str | None = None
    finish: str = "stop"
    usage: dict[str, Any] | None = None


def fold_completion(chunks: Iterable[Frame], ctx: RequestContext) -> dict[str, Any]:
    """The `chat.completion` body that a client accumulating these chunks ends up with."""
    folded = _Folded()
    calls: dict[int, dict[str, Any]] = {}
    logprobs: list[dict[str, Any]] = []
    first: dict[str, Any] | None = None
    for frame in chunks:
        if not isinstance(frame.data, dict):
            continue  # [DONE]
        first = first or frame.data
        if frame.data.get("usage"):
            folded.usage = frame.data["usage"]
        for choice in frame.data["choices"]:
            _fold_choice(choice, folded, calls, logprobs)
    assert first is not None, "the chunk sequence always opens with the role chunk"
    message: dict[str, Any] = {
        "role": "assistant",
        "content": folded.content,
        "refusal": None,
        "annotations": [],
    }
    if calls:
        message["content"] = folded.content if folded.content.strip() else None
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    if folded.reasoning is not None:
        message["reasoning_content"] = folded.reasoning
    choice = {
        "index": 0,
        "message": message,
        "logprobs": {"content": logprobs, "refusal": None} if ctx.request.logprobs else None,
        "finish_reason": folded.finish,
    }
    return {
        "id": first["id"],
        "object": "chat.completion",
        "created": first["created"],
        "model": first["model"],
        "service_tier": SERVICE_TIER,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": [choice],
        "usage": folded.usage,
    }


def _fold_choice(
    choice: dict[str, Any],
    folded: _Folded,
    calls: dict[int, dict[str, Any]],
    logprobs: list[dict[str, Any]],
) -> None:
    delta = choice["delta"]
    folded.content += delta.get("content") or ""
    if "reasoning_content" in delta:
        folded.reasoning = (folded.reasoning or "") + delta["reasoning_content"]
    for part in delta.get("tool_calls", ()):
        fn = part["function"]
        if "id" in part:  # the call's first chunk
            calls[part["index"]] = {"id": part["id"], "type": "function", "function": dict(fn)}
        else:
            calls[part["index"]]["function"]["arguments"] += fn["arguments"]
    if choice["logprobs"]:
        logprobs += choice["logprobs"]["content"]
    if choice["finish_reason"]:
        folded.finish = choice["finish_reason"]


__all__ = ["fold_completion"]
