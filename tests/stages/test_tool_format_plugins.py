"""Tool-call formats are registered plugins: a toy fifth format defined here (no file under
src/ changes) validates, builds and parses; format keys are checked per format, with
positions; the JSON schema completes each format's own keys."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar, Literal

import pytest
from jsonschema import Draft202012Validator
from pydantic import Field

from pipeserve.config.loader import parse_yaml
from pipeserve.config.pipeline_checks import check_pipeline
from pipeserve.config.problems import Problem
from pipeserve.config.schema import json_schema
from pipeserve.events import Event
from pipeserve.request import ToolChoice
from pipeserve.stages import load_builtin_stages
from pipeserve.stages.toolfmt.base import CallSink, MarkerParser, StreamedArgs, ToolFormat, content
from pipeserve.stages.toolfmt.markers import MarkerSet
from pipeserve.stages.toolfmt.registry import (
    TOOL_FORMATS,
    CallFrame,
    ToolFormatParams,
    load_builtin_formats,
    register_tool_format,
)

from .helpers import ENV, make_ctx, run, splits, summarize, token_events, without_usage


class ToyParams(ToolFormatParams):
    """`@@NAME {json}@@`: the name runs to the first space, the arguments to the marker."""

    MARKER_FIELDS: ClassVar[tuple[str, ...]] = ("fence",)

    format: Literal["toy"]
    fence: str = Field("@@", description="Opens and closes a call.")
    prefill_required: str = "@@"
    prefill_function: str = "@@{name} "

    def call_frame(self, name: str) -> CallFrame:
        return CallFrame(f"{self.fence}{name} ", self.fence)


class ToyFormat(MarkerParser):
    def __init__(self, sink: CallSink, fence: str) -> None:
        super().__init__()
        self.sink, self.fence_set = sink, MarkerSet([fence])
        self.head: list[str] | None = None  # the call's name so far, None outside a call
        self.args: StreamedArgs | None = None

    def _markers(self) -> MarkerSet:
        return self.fence_set

    def _text(self, text: str, out: list[Event]) -> None:
        if self.args is not None:
            self.args.feed(text, out)
        elif self.head is None:
            content(text, out)
        else:
            name, space, rest = text.partition(" ")
            self.head.append(name)
            if space:
                self.args = StreamedArgs(self.sink, "".join(self.head), out)
                self.args.feed(rest, out)

    def _marker(self, marker: str, out: list[Event]) -> None:
        if self.head is None:
            self.head = []
            return
        if self.args is not None:
            self.args.end(out)
        self.head, self.args = None, None

    def finish(self, reason: str, out: list[Event]) -> None:
        self.flush(out)
        if self.args is not None:
            self.args.cut(out)
        self.head, self.args = None, None


def toy_parser(params: ToyParams, sink: CallSink, calls_enabled: bool) -> ToolFormat:
    """Toy: `@@NAME {json}@@`."""
    return ToyFormat(sink, params.fence)


@pytest.fixture
def toy() -> Iterator[None]:
    load_builtin_formats()
    register_tool_format("toy", ToyParams)(toy_parser)
    yield
    TOOL_FORMATS.pop("toy")


PIPELINE = """\
family: toy
stages:
  - generate: {}
  - tool_calls: {format: toy, fence: "%%"}
"""


def checked(text: str) -> tuple[object, list[Problem]]:
    doc = parse_yaml(text, file="toy.yaml")
    return check_pipeline(doc, load_builtin_stages())


def test_a_format_defined_outside_src_validates_builds_and_parses(toy: None) -> None:
    pipeline, problems = checked(PIPELINE)
    assert problems == [] and pipeline is not None
    entry = pipeline.stages[-1]  # type: ignore[attr-defined]
    stage = entry.spec.factory(entry.params, ENV)
    text = 'Checking. %%get_weather {"city": "Oslo", "days": "2"}%% done'
    expected = [
        ("content", "Checking. "),
        ("call", "get_weather", '{"city": "Oslo", "days": 2}'),
        ("content", " done"),
        ("finish", "tool_calls"),
    ]
    for pieces in splits(text, ["%%"]):
        assert without_usage(summarize(run(stage, token_events(pieces)))) == expected, pieces


def test_the_toy_format_forces_a_call_with_its_own_prefill(toy: None) -> None:
    pipeline, _ = checked(PIPELINE.replace(', fence: "%%"', ""))
    entry = pipeline.stages[-1]  # type: ignore[attr-defined]
    stage = entry.spec.factory(entry.params, ENV)
    ctx = make_ctx(tool_choice=ToolChoice("function", "get_time"))
    got = summarize(run(stage, token_events(['{"tz": "CET"}', "@@"]), ctx))
    assert ctx.assistant_prefill == "@@get_time "
    assert got[:2] == [("call", "get_time", '{"tz": "CET"}'), ("finish", "tool_calls")]


def test_a_key_of_another_format_is_a_positioned_error() -> None:
    text = 'family: x\nstages:\n  - generate: {}\n  - tool_calls: {format: json, section_start: "<s>"}\n'
    _, problems = checked(text)
    assert [str(p) for p in problems] == [
        "toy.yaml:4:32: stages[1].tool_calls.section_start: unknown key 'section_start'"
        " (known: end, format, prefill_function, prefill_required, start)"
    ]
    _, problems = checked(text.replace("format: json", "format: kimi"))
    assert problems == []


def test_a_misspelt_key_or_format_gets_a_suggestion(toy: None) -> None:
    _, problems = checked(PIPELINE.replace("fence:", "fense:"))
    assert [p.message for p in problems] == ["unknown key 'fense'; did you mean 'fence'?"]
    _, problems = checked(PIPELINE.replace("format: toy", "format: tyo"))
    assert len(problems) == 1 and problems[0].path == "stages[1].tool_calls.format"
    assert problems[0].message.endswith("did you mean 'toy'?")
    _, problems = checked(PIPELINE.replace("format: toy, ", ""))
    assert [(p.path, p.message) for p in problems] == [
        ("stages[1].tool_calls.format", "Field required")
    ]


def test_the_schema_completes_each_formats_own_keys(toy: None) -> None:
    schema = json_schema("pipeline")
    members = schema["$defs"]["ToolCallsParams"]["oneOf"]
    names = [m["$ref"].split("/")[-1] for m in members]
    assert names == [
        "DeepSeekParams", "GemmaParams", "GlmParams", "GraniteParams", "HarmonyParams",
        "JsonParams", "KimiParams", "Llama3Params", "MistralParams", "Phi4Params",
        "Qwen3CoderParams", "ToyParams",
    ]  # fmt: skip
    assert set(schema["$defs"]["ToyParams"]["properties"]) == {
        "format",
        "fence",
        "prefill_required",
        "prefill_function",
    }
    validator = Draft202012Validator(schema)
    good = {"family": "x", "stages": [{"generate": {}}, {"tool_calls": {"format": "toy"}}]}
    assert list(validator.iter_errors(good)) == []
    bad = {"family": "x", "stages": [{"tool_calls": {"format": "json", "section_start": "<s>"}}]}
    assert list(validator.iter_errors(bad))


def test_every_builtin_format_declares_its_markers_and_call_frame() -> None:
    formats = load_builtin_formats()
    assert set(formats) >= {"json", "glm", "kimi", "harmony"}
    json_params = formats["json"].params_model(format="json")
    assert json_params.markers() == {"start": "<tool_call>", "end": "</tool_call>"}
    frame = json_params.call_frame("f")
    assert frame.prefix + '{"a": 1}' + frame.suffix == (
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    )
    kimi = formats["kimi"].params_model(format="kimi")
    assert set(kimi.markers()) == {"section_start", "start", "args_marker", "end", "section_end"}
    assert formats["glm"].params_model(format="glm").call_frame("f") is None
