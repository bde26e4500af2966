"""Pydantic models of the Anthropic Messages request body (the parts we read).

Every model ignores unknown fields: clients add fields (context_management,
container, mcp_servers, ...) faster than servers learn them.
Numbers are strict (no "5" -> 5). `content`, `system` and `tools` entries are kept as
raw JSON here and checked block by block in decode.py, so every error names the
exact path (`messages.2.content.1.tool_use_id`).
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeserve.errors import ApiError, invalid

M = TypeVar("M", bound=BaseModel)


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class MessageParam(Lenient):
    # "system" is not in the published spec, but Claude Code sends it inside messages.
    role: Literal["user", "assistant", "system"]
    content: Any


class TextBlock(Lenient):
    type: Literal["text"]
    text: str


class ToolUseBlock(Lenient):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Any = None
    is_error: bool | None = False


class ThinkingBlock(Lenient):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # ours is never verified; see encode.py


class DocumentBlock(Lenient):
    type: Literal["document"]
    source: dict[str, Any]
    title: str | None = None
    context: str | None = None


class SearchResultBlock(Lenient):
    type: Literal["search_result"]
    source: str
    title: str
    content: list[dict[str, Any]]


class ToolParam(Lenient):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None  # strict tool use: arguments valid against input_schema


class ToolChoiceParam(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = False


class ThinkingParam(Lenient):
    # "adaptive" (Claude Code 2.1) and "between_tools" are newer than the budget form.
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None  # omitted: empty thinking text


class OutputConfigParam(Lenient):
    effort: Any = None  # read leniently: unknown efforts (newer clients) are ignored
    format: Any = None  # structured outputs: read by api/structured.py


class MessagesBody(Lenient):
    model: str = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    messages: list[MessageParam]
    system: Any = None
    tools: list[Any] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfigParam | None = None
    output_format: Any = None  # the structured-outputs beta spelling of output_config.format
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool | None = False  # null (sent by some clients) means absent
    mock_response: str | None = None  # replay models only


class CountTokensBody(MessagesBody):
    max_tokens: int | None = Field(default=None, ge=1)  # type: ignore[assignment]


def path(loc: tuple[str | int, ...]) -> str:
    return ".".join(str(part) for part in loc)


def check(model: type[M], data: Any, loc: tuple[str | int, ...] = ()) -> M:
    """Validate `data`; the first problem becomes a 400 naming its dotted path."""
    if not isinstance(data, dict):
        where = path(loc)
        if not where:
            raise invalid("the request body must be a JSON object")
        raise invalid(f"{where}: Input should be an object", where)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, loc) from None


def validation_error(exc: ValidationError, loc: tuple[str | int, ...] = ()) -> ApiError:
    first = exc.errors(include_url=False)[0]
    where = path((*loc, *first["loc"]))
    # pydantic names our model classes here; clients only need to know an object is expected
    msg = "Input should be an object" if first["type"] == "model_type" else str(first["msg"])
    return invalid(f"{where}: {msg}" if where else msg, where or None)
