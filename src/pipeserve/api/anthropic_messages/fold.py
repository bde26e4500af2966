"""The non-streaming Anthropic message: the stream events MessageEvents (encode.py)
produces, accumulated as the SDKs accumulate a stream."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

from pipeserve.api.anthropic_messages.encode import ERROR_KINDS
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError, ErrorKind

log = logging.getLogger(__name__)


def fold_message(stream: Iterable[dict[str, Any]], ctx: RequestContext) -> dict[str, Any]:
    """Accumulate stream events into the final message, as the SDKs do."""
    message: dict[str, Any] | None = None
    json_bufs: dict[int, str] = {}
    for event in stream:
        kind = event["type"]
        if kind == "error":
            error = event["error"]
            raise ApiError(ERROR_KINDS.get(error["type"], "internal"), error["message"])
        if kind == "message_start":
            message = dict(event["message"], content=[])
        elif message is None:
            continue  # pings before message_start
        elif kind == "content_block_start":
            message["content"].append(dict(event["content_block"]))
        elif kind == "content_block_delta":
            apply_delta(
                message["content"][event["index"]], event["delta"], json_bufs, event["index"]
            )
        elif kind == "content_block_stop" and event["index"] in json_bufs:
            message["content"][event["index"]]["input"] = parse_input(json_bufs.pop(event["index"]))
        elif kind == "message_delta":
            message.update(event["delta"])
            message["usage"] = {**message["usage"], **event["usage"]}
        elif kind == "message_stop":
            return message
    reason = ctx.cancel_reason or "cancelled"
    error_kind: ErrorKind = "timeout" if reason == "timeout" else "internal"
    raise ApiError(error_kind, f"generation was cancelled ({reason})")


def apply_delta(
    block: dict[str, Any], delta: dict[str, Any], json_bufs: dict[int, str], index: int
) -> None:
    kind = delta["type"]
    if kind == "text_delta":
        block["text"] += delta["text"]
    elif kind == "thinking_delta":
        block["thinking"] += delta["thinking"]
    elif kind == "signature_delta":
        block["signature"] = delta["signature"]
    elif kind == "input_json_delta":
        json_bufs[index] = json_bufs.get(index, "") + delta["partial_json"]


def parse_input(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        log.warning("tool call arguments are not valid JSON: %.200s", text)
        return {}
    return value if isinstance(value, dict) else {}


__all__ = ["fold_message"]
