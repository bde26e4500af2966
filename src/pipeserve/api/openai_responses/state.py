"""Responses state: what the response store adds to a request, and what it keeps.

Before generation: `previous_response_id` becomes the earlier turns' input and output
items (instructions are not carried over), and `item_reference` inputs become the stored
items they name. After generation: a response asked to be stored (`store` defaults to
true) is saved with its input items, before its last event or body is sent, so that a
client's next request (on any worker) finds it. Without a store both inputs are refused
with a 400 saying so, and responses echo `store: false`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pipeserve.api.openai_common import new_id
from pipeserve.errors import ApiError, invalid
from pipeserve.store import (
    MissingResponse,
    ResponseStore,
    StoreBusy,
    StoreError,
    StoreUnavailable,
)
from pipeserve.store.base import NOBODY_IN_PARTICULAR, Owner

log = logging.getLogger("pipeserve.responses")

ID_PREFIXES = {
    "message": "msg_",
    "function_call": "fc_",
    "function_call_output": "fco_",
    "custom_tool_call": "ctc_",
    "custom_tool_call_output": "ctco_",
    "reasoning": "rs_",
}
STORED_STATUSES = frozenset({"completed", "incomplete"})
NOTHING_STORED = "this server stores no responses (server.responses_store: false)"


@dataclass
class ResolvedInput:
    """A request's conversation with the store's parts filled in."""

    earlier: list[dict[str, Any]] = field(default_factory=list)  # previous_response_id chain
    items: Any = None  # `input` with every item_reference replaced by its item
    record: list[dict[str, Any]] | None = None  # input items to store; None: not stored


class ResponsesState:
    def __init__(self, store: ResponseStore | None = None) -> None:
        self.store = store

    # ------------------------------------------------------------ before generation

    def resolve(
        self,
        raw_input: Any,
        previous_id: str | None,
        store_requested: bool | None,
        owner: Owner = NOBODY_IN_PARTICULAR,
    ) -> ResolvedInput:
        """Only the owner's responses and items are found (others' are as unknown)."""
        if self.store is None:
            return self._stateless(raw_input, previous_id)
        try:
            earlier = self._earlier(previous_id, owner)
            items = self._dereference(raw_input, owner)
        except StoreError as exc:
            raise store_fault(exc) from exc
        record = input_records(items) if store_requested is not False else None
        return ResolvedInput(earlier, items, record)

    def _stateless(self, raw_input: Any, previous_id: str | None) -> ResolvedInput:
        if previous_id is not None:
            message = (
                f"previous_response_id cannot be resolved: {NOTHING_STORED}; resend the full input."
            )
            raise invalid(message, "previous_response_id")
        for i, item in enumerate(raw_input if isinstance(raw_input, list) else []):
            if isinstance(item, dict) and item.get("type") == "item_reference":
                message = f"'input[{i}]': item_reference cannot be resolved: {NOTHING_STORED}; send the item."
                raise invalid(message, f"input[{i}]")
        return ResolvedInput(items=raw_input)

    def _earlier(self, previous_id: str | None, owner: Owner) -> list[dict[str, Any]]:
        if previous_id is None:
            return []
        assert self.store is not None
        try:
            return self.store.history(previous_id, owner)
        except MissingResponse as missing:
            message = f"Previous response with id '{missing.response_id}' not found."
            if missing.response_id != previous_id:
                message += f" It is earlier in the chain of '{previous_id}' (deleted or expired)."
            raise ApiError(
                "invalid_request",
                message,
                "previous_response_id",
                code="previous_response_not_found",
            ) from missing

    def _dereference(self, raw_input: Any, owner: Owner) -> Any:
        if not isinstance(raw_input, list):
            return raw_input
        wanted = {i: item.get("id") for i, item in enumerate(raw_input) if is_reference(item)}
        if not wanted:
            return raw_input
        for i, item_id in wanted.items():
            if not isinstance(item_id, str) or not item_id:
                raise invalid(
                    f"'input[{i}].id': an item_reference needs the item's id.", f"input[{i}].id"
                )
        assert self.store is not None
        found = self.store.items([str(item_id) for item_id in wanted.values()], owner)
        items = list(raw_input)
        for i, item_id in wanted.items():
            if item_id not in found:
                raise ApiError("not_found", f"Item with id '{item_id}' not found.", f"input[{i}]")
            items[i] = found[item_id]
        return items

    # ------------------------------------------------------------ after generation

    def keep(
        self,
        record: list[dict[str, Any]] | None,
        response: dict[str, Any],
        owner: Owner = NOBODY_IN_PARTICULAR,
        model: str | None = None,
    ) -> None:
        """Store a finished response as the owner's, answered by `model` (the served
        model's own name); on a store fault it is answered unstored (store false)."""
        if self.store is None or record is None or response.get("status") not in STORED_STATUSES:
            return
        try:
            previous = response.get("previous_response_id")
            self.store.save(response, record, previous, owner, model)
        except StoreError as exc:
            # An outage is logged once by the store, not with every answer during it.
            quiet = isinstance(exc, StoreUnavailable) and not isinstance(exc, StoreBusy)
            level = logging.DEBUG if quiet else logging.WARNING
            log.log(level, "response %s is answered unstored: %s", response.get("id"), exc)
            response["store"] = False


def is_reference(item: Any) -> bool:
    return isinstance(item, dict) and item.get("type") == "item_reference"


def store_fault(exc: StoreError) -> ApiError:
    """A 503 (with Retry-After) while the store is busy or unreachable; else a 500."""
    if isinstance(exc, StoreBusy):
        return ApiError("unavailable", "the response store is busy; retry shortly", retry_after=1)
    if isinstance(exc, StoreUnavailable):  # why is logged once per outage (it names the host)
        message = "the response store is unavailable; retry later"
        return ApiError("unavailable", message, retry_after=1)
    log.error("response store failed: %s", exc)
    return ApiError("internal", "the response store failed; the server's log says why")


def input_records(items: Any) -> list[dict[str, Any]]:
    """Input items as stored and listed by /input_items: typed, each with an id."""
    if isinstance(items, str):
        return [record({"type": "message", "role": "user", "content": items})]
    return [record(item) for item in items or [] if isinstance(item, dict)]


def record(item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type") or ("message" if "role" in item else "item")
    stored = {**item, "type": kind}
    if not stored.get("id"):
        stored["id"] = new_id(ID_PREFIXES.get(kind, "item_"))
    if kind == "message":
        stored["content"] = message_parts(stored.get("role"), stored.get("content"))
        stored.setdefault("status", "completed")
    elif kind in ("function_call", "function_call_output"):
        stored.setdefault("status", "completed")
    return stored


def message_parts(role: Any, content: Any) -> Any:
    """Message content as typed parts: output_text for assistant text, else input_text."""
    assistant = role == "assistant"
    if isinstance(content, str):
        content = [{"type": "output_text" if assistant else "input_text", "text": content}]
    if not isinstance(content, list):
        return content
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "output_text":
            part = {"annotations": [], **part}
        parts.append(part)
    return parts


__all__ = ["ResolvedInput", "ResponsesState", "input_records", "store_fault"]
