"""Drive stages with lists of events and summarize their output into readable tuples."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from pipeserve.events import (
    ContentDelta,
    Event,
    Finish,
    PromptReady,
    ReasoningDelta,
    TokenText,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from pipeserve.request import GenerationRequest, Message, ToolChoice, ToolSpec
from pipeserve.stages.base import BuildEnv, RequestContext, Stage

ENV = BuildEnv(model_name="test", family="test")

WEATHER = ToolSpec(
    "get_weather",
    "Weather for a city",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "metric": {"type": "boolean"},
            "ratio": {"type": "number"},
            "options": {"type": "object", "properties": {"hourly": {"type": "boolean"}}},
            "hours": {"type": "array", "items": {"type": "integer"}},
            "note": {"type": ["string", "null"]},
        },
        "required": ["city"],
    },
)
TIME = ToolSpec(
    "get_time", "Current time", {"type": "object", "properties": {"tz": {"type": "string"}}}
)
TOOLS = [WEATHER, TIME]


def make_ctx(
    tools: list[ToolSpec] | None = None,
    stop: list[str] | None = None,
    tool_choice: ToolChoice | None = None,
    opened_thinking: bool = False,
) -> RequestContext:
    request = GenerationRequest(
        model="test",
        messages=[Message("user", "hi")],
        tools=TOOLS if tools is None else tools,
        tool_choice=tool_choice or ToolChoice(),
        stop=stop or [],
    )
    ctx = RequestContext(request=request, request_id="req-1", model_name="test")
    ctx.prompt_opened_thinking = opened_thinking
    return ctx


def token_events(texts: Iterable[str], finish: str = "stop") -> list[Event]:
    tokens = [TokenText(text, 1000 + i) for i, text in enumerate(texts)]
    return [PromptReady(5), *tokens, Finish(finish), Usage(5, len(tokens))]  # type: ignore[arg-type]


def run(
    stage: Stage, events: list[Event], ctx: RequestContext | None = None, prepare: bool = True
) -> list[Event]:
    ctx = ctx or make_ctx()
    if prepare:
        stage.prepare(ctx)
    return list(stage(iter(events), ctx))


def summarize(events: Iterable[Event]) -> list[tuple[Any, ...]]:
    """Merge adjacent text of one kind; fold each tool call into ("call", name, args).

    Checks the tool-call invariants on the way: unique `call_` ids, indices in order,
    fragments that concatenate to ToolCallEnd.arguments.
    """
    out: list[tuple[Any, ...]] = []
    calls: dict[int, list[Any]] = {}
    ids: set[str] = set()
    for event in events:
        if isinstance(event, (ContentDelta, TokenText)):
            _text(out, "content", event.text)
        elif isinstance(event, ReasoningDelta):
            _text(out, "reasoning", event.text)
        elif isinstance(event, ToolCallStart):
            assert event.id.startswith("call_") and event.id not in ids, event.id
            assert event.index == len(calls), (event.index, len(calls))
            ids.add(event.id)
            calls[event.index] = [event.name, []]
        elif isinstance(event, ToolCallArgsDelta):
            assert event.fragment, "empty fragment"
            calls[event.index][1].append(event.fragment)
        elif isinstance(event, ToolCallEnd):
            name, fragments = calls[event.index]
            assert "".join(fragments) == event.arguments, (fragments, event.arguments)
            out.append(("call", name, event.arguments))
        elif isinstance(event, Finish):
            out.append(
                ("finish", event.reason) + ((event.stop_sequence,) if event.stop_sequence else ())
            )
        elif isinstance(event, Usage):
            out.append(("usage", event.completion_tokens, event.reasoning_tokens))
        elif isinstance(event, PromptReady):
            continue
        else:
            out.append((type(event).__name__,))
    return out


def _text(out: list[tuple[Any, ...]], kind: str, text: str) -> None:
    if not text:
        return
    if out and out[-1][0] == kind:
        out[-1] = (kind, out[-1][1] + text)
    else:
        out.append((kind, text))


def without_usage(summary: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    return [item for item in summary if item[0] != "usage"]


def splits(text: str, markers: Iterable[str]) -> Iterator[list[str]]:
    """Tokenizations of `text`: whole, char by char, and every split point of every marker
    occurrence across two tokens (the text before and after stays whole)."""
    yield [text]
    yield list(text)
    for marker in markers:
        start = text.find(marker)
        while start != -1:
            for k in range(1, len(marker)):
                cut = start + k
                yield [text[:cut], text[cut:]]
                yield [
                    p
                    for p in (text[:start], marker[:k], marker[k:], text[start + len(marker) :])
                    if p
                ]
            start = text.find(marker, start + 1)


def args(summary: list[tuple[Any, ...]]) -> list[Any]:
    return [json.loads(item[2]) for item in summary if item[0] == "call"]
