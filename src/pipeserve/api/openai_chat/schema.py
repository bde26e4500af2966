"""Pydantic models of the OpenAI Chat Completions request body (the fields we read).

Unknown fields are accepted and ignored (`Lenient`); numbers and enums are strict, and a
malformed known field is a 400 naming it (`messages[2].content[0].text`, see
api/openai_common.py `validate`). The decoder (decode.py) turns these into a
GenerationRequest.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pipeserve.api.openai_common import Lenient, check, seed_value
from pipeserve.request import SamplingParams, sampling_params


class FunctionCallIn(Lenient):
    name: str
    arguments: Any = ""


class ToolCallIn(Lenient):
    id: str
    type: str = "function"
    function: FunctionCallIn


class MessageIn(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Any = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: Any = None  # the newer vLLM / OpenRouter spelling (a string when used that way)


class StreamOptions(Lenient):
    include_usage: bool | None = None


class OpenAISamplingIn(Lenient):
    """The sampling fields Chat and legacy Completions share; left out, the model's
    sampling defaults apply (YAML / generation_config.json)."""

    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = None
    logit_bias: Any = None  # checked by logit_bias_of

    def sampling(self) -> SamplingParams:
        return sampling_params(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=None if self.top_k is None else max(self.top_k, 0),
            min_p=self.min_p,
            repetition_penalty=None
            if self.repetition_penalty is None
            else self.repetition_penalty or 1.0,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=logit_bias_of(self.logit_bias),
            seed=seed_value(self.seed),
        )


class ChatRequestIn(OpenAISamplingIn):
    model: str
    messages: list[MessageIn] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    stop: Any = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    reasoning_effort: str | None = None
    parallel_tool_calls: bool | None = None
    mock_response: str | None = None
    chat_template_kwargs: Any = None  # checked by api/template_kwargs
    prediction: Any = None  # Predicted Outputs: checked by decode.prediction_of
    # Known fields this server cannot honour: refused when set to anything but a no-op
    # (see _refuse_unhonoured). Other known fields -- user, metadata, store, service_tier,
    # verbosity, prompt_cache_key, safety_identifier, web_search_options --
    # only affect billing, storage, latency or hosted tools and are accepted and ignored.
    response_format: Any = None
    modalities: Any = None
    audio: Any = None
    functions: Any = None
    function_call: Any = None


def logit_bias_of(raw: Any) -> dict[int, float]:
    """`{"token id": bias}` in this model's vocabulary (ids are checked against it later)."""
    if raw is None:
        return {}
    check(isinstance(raw, dict), "logit_bias", "expected an object mapping token ids to biases")
    bias: dict[int, float] = {}
    for key, value in raw.items():
        check(isinstance(key, str) and key.isdigit(), "logit_bias", f"{key!r} is not a token id")
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        check(
            number and -100 <= value <= 100,
            "logit_bias",
            f"the bias of {key} must be a number in [-100, 100]",
        )
        bias[int(key)] = float(value)
    return bias
