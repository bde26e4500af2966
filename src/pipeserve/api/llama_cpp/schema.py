"""Pydantic models of llama.cpp's `/infill`, `/tokenize` and `/detokenize` bodies (the
fields we read). Unknown fields (llama.cpp's own runtime knobs: `cache_prompt`,
`samplers`, `t_max_predict_ms`...) are accepted and ignored; a malformed known field is
a 400 naming it."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from pipeserve.api.openai_common import Lenient

MAX_STOP = 16


class ExtraFileIn(Lenient):
    filename: str = "tmp"
    text: str = ""


class InfillIn(Lenient):
    model: str | None = None
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraFileIn] = Field(default_factory=list)
    prompt: str = ""
    n_predict: int | None = Field(None, ge=-1)
    max_tokens: int | None = Field(None, ge=1)  # llama.cpp's alias of n_predict
    stream: bool | None = None
    temperature: float | None = Field(None, ge=0)
    top_k: int | None = None
    top_p: float | None = Field(None, ge=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    repeat_penalty: float | None = Field(None, ge=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = None
    stop: list[str] | None = Field(None, max_length=MAX_STOP)
    n_probs: int | None = None
    mock_response: str | None = None  # replay models only


class TokenizeIn(Lenient):
    model: str | None = None
    content: str | None = None
    messages: Any = None  # OpenAI Chat messages, checked by Chat's decoder
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeIn(Lenient):
    model: str | None = None
    tokens: list[int] = Field(default_factory=list)
