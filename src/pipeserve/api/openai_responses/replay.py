"""A stored response as a stream again (`GET /v1/responses/{id}?stream=true`).

The events are rebuilt from the stored Response object, one delta per text, in the same
order and shapes the live stream uses; `starting_after` skips events up to that
sequence number (numbers are those of the rebuilt stream).
"""

from __future__ import annotations

import copy
from typing import Any

Event = dict[str, Any]


class _Numbered:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def add(self, kind: str, **fields: Any) -> None:
        self.events.append({"type": kind, "sequence_number": len(self.events), **fields})


def replay_events(response: dict[str, Any], starting_after: int | None = None) -> list[Event]:
    out = _Numbered()
    opening = {**copy.deepcopy(response), "status": "in_progress", "output": [], "usage": None}
    opening.update(completed_at=None, error=None, incomplete_details=None)
    out.add("response.created", response=opening)
    out.add("response.in_progress", response=opening)
    for index, item in enumerate(response.get("output") or []):
        _item_events(out, index, item)
    final = (
        "response.incomplete" if response.get("status") == "incomplete" else "response.completed"
    )
    out.add(final, response=response)
    return [
        e for e in out.events if starting_after is None or e["sequence_number"] > starting_after
    ]


def _item_events(out: _Numbered, index: int, item: dict[str, Any]) -> None:
    kind = item.get("type")
    added = copy.deepcopy(item)
    if kind == "message":
        added.update(content=[], status="in_progress")
    elif kind == "reasoning":
        added.update(summary=[], content=[])
        added.pop("encrypted_content", None)
    elif kind == "function_call":
        added.update(arguments="", status="in_progress")
    out.add("response.output_item.added", output_index=index, item=added)
    ids = {"item_id": item.get("id"), "output_index": index}
    if kind == "message":
        for part_index, part in enumerate(item.get("content") or []):
            _text_part(out, ids, part_index, part)
    elif kind == "reasoning":
        for summary_index, part in enumerate(item.get("summary") or []):
            _summary_part(out, ids, summary_index, part)
        for part_index, part in enumerate(item.get("content") or []):
            _reasoning_part(out, ids, part_index, part)
    elif kind == "function_call":
        arguments = item.get("arguments", "")
        out.add("response.function_call_arguments.delta", **ids, delta=arguments)
        out.add(
            "response.function_call_arguments.done", **ids, arguments=arguments, name=item["name"]
        )
    out.add("response.output_item.done", output_index=index, item=item)


def _text_part(out: _Numbered, ids: dict[str, Any], index: int, part: dict[str, Any]) -> None:
    text, logprobs = part.get("text", ""), part.get("logprobs") or []
    empty = {**part, "text": "", "logprobs": []}
    out.add("response.content_part.added", **ids, content_index=index, part=empty)
    out.add("response.output_text.delta", **ids, content_index=index, delta=text, logprobs=logprobs)
    out.add("response.output_text.done", **ids, content_index=index, text=text, logprobs=logprobs)
    out.add("response.content_part.done", **ids, content_index=index, part=part)


def _reasoning_part(out: _Numbered, ids: dict[str, Any], index: int, part: dict[str, Any]) -> None:
    text = part.get("text", "")
    out.add("response.content_part.added", **ids, content_index=index, part={**part, "text": ""})
    out.add("response.reasoning_text.delta", **ids, content_index=index, delta=text)
    out.add("response.reasoning_text.done", **ids, content_index=index, text=text)
    out.add("response.content_part.done", **ids, content_index=index, part=part)


def _summary_part(out: _Numbered, ids: dict[str, Any], index: int, part: dict[str, Any]) -> None:
    text = part.get("text", "")
    empty = {"type": "summary_text", "text": ""}
    out.add("response.reasoning_summary_part.added", **ids, summary_index=index, part=empty)
    out.add("response.reasoning_summary_text.delta", **ids, summary_index=index, delta=text)
    out.add("response.reasoning_summary_text.done", **ids, summary_index=index, text=text)
    out.add("response.reasoning_summary_part.done", **ids, summary_index=index, part=part)


__all__ = ["replay_events"]
