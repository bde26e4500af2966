"""Pydantic models of the OpenAI Responses request body and its input items (the fields
we read). Unknown fields are accepted and ignored (`Lenient`); a malformed known field is
a 400 naming it. The decoder (decode.py) turns these into a GenerationRequest."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pipeserve.api.openai_common import Lenient


class ReasoningIn(Lenient):
    effort: str | None = None
    # any of them: the reasoning text is sent as the item's summary (we do not shorten it)
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequestIn(Lenient):
    model: str
    input: Any = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    stream: bool | None = None
    reasoning: ReasoningIn | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, Any] | None = None
    mock_response: str | None = None
    prompt: Any = None  # a stored prompt template: cannot be resolved here, refused
    truncation: Literal["auto", "disabled"] | None = None
    # Echoed, otherwise no effect: they apply to built-in tools, storage, caching or billing.
    max_tool_calls: int | None = Field(None, ge=1)
    store: bool | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None


class MessageItem(Lenient):
    role: Literal["user", "assistant", "system", "developer"]
    content: Any


class FunctionCallItem(Lenient):
    call_id: str
    name: str
    arguments: Any = ""
    namespace: str | None = None


class CallOutputItem(Lenient):
    call_id: str
    output: Any = ""


class CustomCallItem(Lenient):
    call_id: str
    name: str
    input: str = ""


class ReasoningItem(Lenient):
    summary: list[Any] | None = None
    content: list[Any] | None = None
    encrypted_content: str | None = None
