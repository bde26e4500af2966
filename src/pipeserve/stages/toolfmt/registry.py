"""The tool-call format registry: one `<name>_format.py` module per format, like stages.

A format module declares its parameter model (a ToolFormatParams subclass whose
`format` field is `Literal["<name>"]`, with the format's markers and prefills as
defaults) and registers a parser factory under its name:

    @register_tool_format("json", JsonParams)
    def json_parser(params: JsonParams, sink: CallSink, calls_enabled: bool) -> ToolFormat: ...

The `tool_calls` stage validates its YAML params against the registered models (a union
discriminated on `format`), so a key of one format under another is a positioned error.
`load_builtin_formats` imports every `*_format.py` module of this package: adding a
format is one new file plus YAML (docs/extending.md).
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeAlias, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field

from pipeserve.constraint import Envelope
from pipeserve.stages.toolfmt.base import CallSink, ToolFormat


@dataclass(frozen=True)
class CallFrame:
    """The text a format writes around one call's JSON-object arguments.

    `prefix + json.dumps(arguments) + suffix` is one complete call to the named tool,
    which is what a grammar that forces a call needs.
    """

    prefix: str
    suffix: str


@dataclass(frozen=True)
class PairFrame:
    """A call whose arguments are written as key/value pairs (GLM), not one JSON object:
    `prefix (key_open KEY key_close separator value_open VALUE value_close separator)*
    suffix`; string values are plain text, others JSON."""

    prefix: str
    suffix: str
    key_open: str
    key_close: str
    value_open: str
    value_close: str
    separator: str = "\n"


@dataclass(frozen=True)
class CallsLayout:
    """Where calls may sit in an answer the model writes freely (tool_choice auto).

    `trigger` starts every call (each call frame's prefix begins with it): free text
    never contains it, so once it is written a call follows. `separator` sits between
    consecutive calls. `after_text`: calls follow the answer's free text inside the
    answer; False: a call is a message of its own instead of the answer (Harmony).
    `single`: a call ends the turn (Harmony's `<|call|>` stops generation).
    """

    trigger: str
    separator: str = ""
    after_text: bool = True
    single: bool = False


class ToolFormatParams(BaseModel):
    """Base of every format's parameters. Unknown keys (another format's too) are errors.

    Subclasses list their marker fields in MARKER_FIELDS, override the prefill
    defaults, and override `call_frame` when a call's arguments are one JSON object.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    MARKER_FIELDS: ClassVar[tuple[str, ...]] = ()

    format: str
    prefill_required: str = Field("", description="Prompt suffix that forces some call.")
    prefill_function: str = Field(
        "", description="Prompt suffix that forces a call to {name} ({name} is replaced)."
    )

    def markers(self) -> dict[str, str]:
        """The format's declared marker strings, by parameter name."""
        return {name: str(getattr(self, name)) for name in self.MARKER_FIELDS}

    def call_frame(self, name: str) -> CallFrame | None:
        """The text around a call to `name`; None when arguments are not one JSON object."""
        return None

    def pair_frame(self, name: str) -> PairFrame | None:
        """The pair layout of a call to `name` when arguments are key/value pairs."""
        return None

    def calls_layout(self) -> CallsLayout | None:
        """How calls follow free text (for strict tools under tool_choice auto); None
        when the format declares no layout (strict arguments are then not enforced)."""
        return None

    def envelope(self) -> Envelope | None:
        """How this format frames reasoning and the answer, when it carries them itself
        (Harmony channels); None when a thinking stage or nothing does."""
        return None

    def forced_prefill(self, function: str | None) -> str:
        """The prompt suffix for tool_choice `required` (None) or a named function."""
        if function:
            return self.prefill_function.replace("{name}", function)
        return self.prefill_required


P = TypeVar("P", bound=ToolFormatParams)
ParserFactory: TypeAlias = Callable[[Any, CallSink, bool], ToolFormat]


@dataclass(frozen=True)
class ToolFormatSpec(Generic[P]):
    """A registered format: its params model and the per-request parser factory.

    `parses_without_calls`: the format also carries reasoning or channels, so its parser
    runs even when tool_choice is `none` (it then reports no calls). `warm_up` runs once
    when a stage is built for serving (e.g. to load a tokenizer encoding).
    """

    name: str
    params_model: type[P]
    factory: Callable[[P, CallSink, bool], ToolFormat]
    description: str
    parses_without_calls: bool = False
    warm_up: Callable[[], object] | None = None


TOOL_FORMATS: dict[str, ToolFormatSpec[Any]] = {}


def register_tool_format(
    name: str,
    params: type[P],
    *,
    parses_without_calls: bool = False,
    warm_up: Callable[[], object] | None = None,
) -> Callable[
    [Callable[[P, CallSink, bool], ToolFormat]], Callable[[P, CallSink, bool], ToolFormat]
]:
    """Register a parser factory under `name`; `format: <name>` in YAML selects it."""

    def decorator(
        factory: Callable[[P, CallSink, bool], ToolFormat],
    ) -> Callable[[P, CallSink, bool], ToolFormat]:
        if name in TOOL_FORMATS:
            raise ValueError(f"tool format {name!r} registered twice")
        declared = params.model_fields.get("format")
        if declared is None or get_args(declared.annotation) != (name,):
            raise ValueError(f"{params.__name__}.format must be Literal[{name!r}]")
        text = ((factory.__doc__ or "").strip().splitlines() or [""])[0]
        TOOL_FORMATS[name] = ToolFormatSpec(
            name, params, factory, text, parses_without_calls, warm_up
        )
        return factory

    return decorator


def load_builtin_formats() -> dict[str, ToolFormatSpec[Any]]:
    """Import every `*_format` module of this package (each registers itself)."""
    package = __name__.rsplit(".", 1)[0]
    path = importlib.import_module(package).__path__
    for module in pkgutil.iter_modules(path):
        if module.name.endswith("_format"):
            importlib.import_module(f"{package}.{module.name}")
    return TOOL_FORMATS


def json_call_frame(start: str, end: str, name: str) -> CallFrame:
    """`START\\n{"name": "NAME", "arguments": ` ... `}\\nEND` (the Hermes/Qwen shape)."""
    return CallFrame(f'{start}\n{{"name": {json.dumps(name)}, "arguments": ', f"}}\n{end}")
