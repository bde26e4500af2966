"""Protocol-neutral request errors; each API module renders them in its own shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeAlias

ErrorKind: TypeAlias = Literal[
    "invalid_request",  # 400: malformed JSON, wrong types, missing fields, bad values
    "authentication",  # 401
    "permission",  # 403
    "not_found",  # 404: unknown model or route
    "too_large",  # 413: body or prompt too large
    "rate_limit",  # 429: queue full (OpenAI routes)
    "overloaded",  # 529 on Anthropic routes, 429 on OpenAI routes
    "timeout",  # 504: request timed out in queue or generation
    "body_timeout",  # 408: the client did not send the body it announced
    "internal",  # 500: a bug or an engine fault
    "unavailable",  # 503: engine not ready
]

DEFAULT_STATUS: dict[str, int] = {
    "invalid_request": 400,
    "authentication": 401,
    "permission": 403,
    "not_found": 404,
    "too_large": 413,
    "rate_limit": 429,
    "overloaded": 429,
    "timeout": 504,
    "body_timeout": 408,
    "internal": 500,
    "unavailable": 503,
}


@dataclass
class ApiError(Exception):
    """A client-visible failure. `param` names the offending field (dotted path)."""

    kind: ErrorKind
    message: str
    param: str | None = None
    retry_after: float | None = None
    code: str | None = None  # a protocol's machine-readable code, when it defines one

    def __str__(self) -> str:
        return self.message

    @property
    def default_status(self) -> int:
        return DEFAULT_STATUS[self.kind]


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError("invalid_request", message, param)


class ContextLengthError(ApiError):
    """The prompt does not fit the model's context; protocols render it in the dialect
    agents react to (OpenAI `context_length_exceeded`, Anthropic "prompt is too long")."""

    def __init__(self, prompt_tokens: int, context_length: int) -> None:
        super().__init__(
            "invalid_request",
            f"The prompt is {prompt_tokens} tokens long; this model's context length is {context_length} tokens "
            "(prompt plus at least one generated token). Shorten the conversation.",
            "messages",
        )
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length


class LoadRefused(RuntimeError):
    """A model cannot be loaded now for a reason its message says in full (a sharded
    model's machines are unreachable or too small): logged as one line, no traceback."""


class PlacementError(LoadRefused):
    """A sharded model cannot be placed on its machines now (unreachable, too few or too
    small for its shapes): the message says why; the caller may retry later."""


def refused_load(exc: BaseException) -> LoadRefused | None:
    """The LoadRefused that caused `exc` (a load failure wraps its reason), if any."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, LoadRefused):
            return seen
        seen = seen.__cause__
    return None
