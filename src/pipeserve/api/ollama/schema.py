"""Pydantic models of Ollama's `/api/chat` and `/api/generate` bodies (the fields we
read; see decode.py for what each means). Unknown fields are accepted and ignored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pipeserve.api.openai_common import Lenient


class OptionsIn(Lenient):
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: list[str] | None = None
    num_predict: int | None = None
    repeat_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)


class FunctionCallIn(Lenient):
    name: str
    arguments: Any = None


class ToolCallIn(Lenient):
    function: FunctionCallIn


class MessageIn(Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    thinking: str | None = None
    images: Any = None
    tool_calls: list[ToolCallIn] | None = None
    tool_name: str | None = None


class CommonIn(Lenient):
    model: str = Field(min_length=1)
    stream: bool | None = None
    options: OptionsIn | None = None
    format: Any = None
    think: bool | str | None = None
    keep_alive: Any = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    mock_response: str | None = None  # replay models only


class ChatIn(CommonIn):
    messages: list[MessageIn] | None = None
    tools: list[dict[str, Any]] | None = None


class GenerateIn(CommonIn):
    prompt: str | None = None
    system: str | None = None
    raw: bool | None = None
    suffix: str | None = None
    images: Any = None
    template: Any = None
    context: Any = None
