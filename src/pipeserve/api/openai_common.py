"""Helpers shared by the two OpenAI wire protocols (Chat Completions and Responses).

Validation: request bodies are checked with pydantic models (`extra="allow"`, strict
types); the first error becomes an ApiError whose `param` is the OpenAI-style path
(`messages[0].content[1].type`). Encoding: ids, error bodies, usage and logprobs.

Logprobs handoff: stages after `generate` turn TokenText into ContentDelta, which has
no logprob. The generate stage appends each TokenText to `ctx.logprob_records` when
the request asked for logprobs; an encoder hands out, with each content chunk, the
records appended since its previous chunk (LogprobCursor). A TokenText that reaches the
encoder directly (a pipeline without text stages) carries its own logprob.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from pipeserve.api.base import context_overflow
from pipeserve.api.framing import KEEPALIVE_COMMENT, close_events
from pipeserve.context import RequestContext
from pipeserve.errors import DEFAULT_STATUS, ApiError, invalid
from pipeserve.events import ErrorEvent, TokenText, Usage
from pipeserve.request import MAX_CHOICES, SEED_SPACE, ReasoningOptions, ToolChoice, ToolSpec

KEEPALIVE_FRAME = KEEPALIVE_COMMENT
MAX_TOP_LOGPROBS = 20

M = TypeVar("M", bound=BaseModel)


class Lenient(BaseModel):
    """Base of request models: unknown fields are accepted and ignored, types strict."""

    model_config = ConfigDict(extra="allow", strict=True)


# ---------------------------------------------------------------- validation


def param_path(loc: Sequence[str | int], prefix: str = "") -> str:
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path = f"{path}.{part}" if path else part
    return path


def validate(model: type[M], data: Any, path: str = "") -> M:
    """Validate `data` (a parsed JSON value) as `model`; errors name the field path."""
    if not isinstance(data, dict):
        where = f"'{path}'" if path else "The request body"
        raise invalid(f"{where} must be a JSON object.", path or None)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _api_error(exc, path) from None


def _api_error(exc: ValidationError, prefix: str) -> ApiError:
    error = exc.errors(include_url=False)[0]
    param = param_path(error["loc"], prefix)
    if error["type"] == "missing":
        return invalid(f"Missing required parameter: '{param}'.", param)
    kind = "type" if error["type"].endswith("_type") else "value"
    return invalid(f"Invalid {kind} for '{param}': {error['msg']}.", param)


def check(condition: bool, param: str, problem: str = "missing") -> None:
    """Raise a 400 naming `param` unless condition holds; problem "missing" or a reason."""
    if condition:
        return
    if problem == "missing":
        raise invalid(f"Missing required parameter: '{param}'.", param)
    raise invalid(f"Invalid value for '{param}': {problem}.", param)


def choices_of(n: Any) -> int:
    """`n`: 1 to MAX_CHOICES choices (null: 1)."""
    if n is None:
        return 1
    check(1 <= n <= MAX_CHOICES, "n", f"must be between 1 and {MAX_CHOICES}")
    return int(n)


def unsupported(param: str, why: str) -> ApiError:
    """A 400 for a parameter this server would otherwise silently not honour."""
    return invalid(f"'{param}' is not supported by this server: {why}.", param)


def images_unsupported(param: str) -> ApiError:
    return invalid("images are not supported by this model", param)


def text_of_parts(
    parts: Any, path: str, text_types: frozenset[str], image_types: frozenset[str]
) -> str:
    """Concatenate the text of a content-part list; image parts are a clear 400."""
    if isinstance(parts, str):
        return parts
    if parts is None:
        return ""
    check(isinstance(parts, list), path, "expected a string or an array of content parts")
    texts: list[str] = []
    for i, part in enumerate(parts):
        where = f"{path}[{i}]"
        check(isinstance(part, dict), where, "expected an object")
        kind = part.get("type")
        check(isinstance(kind, str), f"{where}.type", "expected a string")
        if kind in image_types:
            raise images_unsupported(where)
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        check(kind in text_types, f"{where}.type", f"unsupported content part type {kind!r}")
        text = part.get("text")
        check(isinstance(text, str), f"{where}.text", "expected a string")
        texts.append(text)
    return "".join(texts)


def tool_choice_mode(raw: Any) -> ToolChoice | None:
    """The shared part of both OpenAI APIs' tool_choice: absent, or a mode string.
    None means an object, which each API spells its own way."""
    if raw is None:
        return ToolChoice()
    if isinstance(raw, str):
        check(raw in ("auto", "none", "required"), "tool_choice", f"unknown mode {raw!r}")
        return ToolChoice(raw)  # type: ignore[arg-type]
    check(isinstance(raw, dict), "tool_choice", "expected a string or an object")
    return None


def check_tool_choice(choice: ToolChoice, tools: list[ToolSpec], param: str) -> None:
    if choice.mode in ("required", "function") and not tools:
        raise invalid(f"'{param}' {choice.mode!r} is only allowed when tools are specified.", param)
    if choice.mode == "function" and all(t.name != choice.name for t in tools):
        raise invalid(
            f"Invalid value for '{param}': function {choice.name!r} is not in tools.", param
        )


def seed_value(seed: int | None) -> int | None:
    """Any JSON integer is a valid seed (clients send -1 or huge values); fold it into
    the engine's range so it stays deterministic instead of failing in the engine."""
    return None if seed is None else seed % SEED_SPACE


EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def reasoning_options(effort: str | None, param: str) -> ReasoningOptions:
    """`none` turns reasoning off; efforts above `high` clamp to `high`."""
    if effort is None:
        return ReasoningOptions()
    check(effort in EFFORTS, param, f"{effort!r} is not one of {', '.join(EFFORTS)}")
    if effort == "none":
        return ReasoningOptions(enabled=False)
    clamped = "high" if effort in ("xhigh", "max") else effort
    return ReasoningOptions(effort=clamped)  # type: ignore[arg-type]


# ---------------------------------------------------------------- encoding


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


_ERROR_SHAPES: dict[str, tuple[str, str | None]] = {
    "invalid_request": ("invalid_request_error", None),
    "authentication": ("authentication_error", "invalid_api_key"),
    "permission": ("permission_error", "permission_denied"),
    "not_found": ("not_found_error", "not_found"),
    "too_large": ("invalid_request_error", "request_too_large"),
    "rate_limit": ("rate_limit_error", "rate_limit_exceeded"),
    "overloaded": ("rate_limit_error", "rate_limit_exceeded"),
    "timeout": ("timeout_error", "timeout"),
    "body_timeout": ("invalid_request_error", "request_timeout"),
    "internal": ("server_error", "server_error"),
    "unavailable": ("server_error", "service_unavailable"),
}


def openai_error_body(error: ApiError) -> dict[str, Any]:
    kind, code = _ERROR_SHAPES.get(error.kind, ("server_error", "server_error"))
    if error.kind == "not_found" and error.param == "model":
        code = "model_not_found"
    elif context_overflow(error) is not None:
        code = "context_length_exceeded"
    code = error.code or code
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": code}}


def api_error_from_event(event: ErrorEvent) -> ApiError:
    kind = event.kind if event.kind in DEFAULT_STATUS else "internal"
    return ApiError(kind, event.message)  # type: ignore[arg-type]


def cancelled_error(ctx: RequestContext) -> ApiError:
    reason = ctx.cancel_reason or "cancelled"
    kind = "timeout" if "timeout" in reason else "internal"
    return ApiError(kind, f"generation was cancelled ({reason})")  # type: ignore[arg-type]


def chat_usage(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": usage.reasoning_tokens,
            "audio_tokens": 0,
            "accepted_prediction_tokens": usage.accepted_prediction_tokens,
            "rejected_prediction_tokens": usage.rejected_prediction_tokens,
        },
    }


def responses_usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def split_namespace(name: str) -> tuple[str | None, str]:
    """`ns.fn` -> ("ns", "fn"): OpenAI names cannot contain dots, so a dot marks a namespace."""
    namespace, dot, plain = name.rpartition(".")
    return (namespace, plain) if dot else (None, name)


# ---------------------------------------------------------------- logprobs


class LogprobCursor:
    """Per-chunk logprob records: those appended to ctx.logprob_records since the last take."""

    def __init__(self, ctx: RequestContext) -> None:
        self.ctx = ctx
        self.wanted = ctx.request.logprobs
        self.top = min(ctx.request.top_logprobs, MAX_TOP_LOGPROBS)
        self.position = 0

    def take(self, direct: TokenText | None = None) -> list[dict[str, Any]]:
        """Entries for a content chunk; `direct` is a TokenText the encoder got itself."""
        records = self.ctx.logprob_records
        pending, self.position = records[self.position :], len(records)
        if not self.wanted:
            return []
        tokens = [direct] if direct is not None else pending
        return [entry for t in tokens if (entry := self.entry(t)) is not None]

    def skip(self) -> None:
        """Drop records of non-content output (reasoning, tool-call markup)."""
        self.position = len(self.ctx.logprob_records)

    def entry(self, token: TokenText) -> dict[str, Any] | None:
        logprob = token.logprob
        if logprob is None:
            return None
        text = token.text
        tops = token.top_logprobs[: self.top]
        return {
            "token": text,
            "logprob": float(logprob),
            "bytes": list(text.encode()),
            "top_logprobs": [
                {"token": t.token, "logprob": float(t.logprob), "bytes": list(t.token.encode())}
                for t in tops
            ],
        }


__all__ = [
    "KEEPALIVE_FRAME",
    "Lenient",
    "LogprobCursor",
    "api_error_from_event",
    "cancelled_error",
    "chat_usage",
    "check",
    "check_tool_choice",
    "close_events",
    "images_unsupported",
    "new_id",
    "openai_error_body",
    "reasoning_options",
    "responses_usage",
    "seed_value",
    "split_namespace",
    "text_of_parts",
    "unsupported",
    "validate",
]
