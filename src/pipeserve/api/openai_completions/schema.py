"""Pydantic models of the legacy OpenAI Completions request body (the fields we read).
The sampling fields are Chat's (OpenAISamplingIn); unknown fields are accepted and
ignored, a malformed known field is a 400 naming it."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from pipeserve.api.openai_chat.schema import OpenAISamplingIn
from pipeserve.api.openai_common import Lenient

MAX_LOGPROBS = 5


class StreamOptions(Lenient):
    include_usage: bool | None = None


class CompletionRequestIn(OpenAISamplingIn):
    model: str
    prompt: Any = None
    suffix: Any = None
    max_tokens: int | None = Field(None, ge=1)
    n: int | None = None
    best_of: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None
    stop: Any = None
    mock_response: str | None = None
