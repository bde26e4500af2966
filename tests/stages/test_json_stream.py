"""The coercing JSON argument streamer: chunking never changes the result, the result is
valid JSON equal to the coerced value, and held values are emitted only when complete."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeserve.stages.toolfmt.coerce import coerce, coerce_text_value
from pipeserve.stages.toolfmt.json_stream import JsonStreamer
from pipeserve.stages.toolfmt.markers import MarkerSet

from .helpers import WEATHER

SCHEMA = WEATHER.parameters

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False, width=32)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
argument_objects = st.fixed_dictionaries(
    {},
    optional={
        "city": json_values,
        "days": st.integers(-99, 99).map(str) | json_values,
        "metric": st.sampled_from(["true", "false", True, "TRUE"]),
        "ratio": st.floats(-5, 5).map(repr),
        "options": st.dictionaries(st.just("hourly"), st.sampled_from(["true", False])).map(
            json.dumps
        ),
        "hours": st.lists(st.integers(0, 23).map(str), max_size=3),
        "note": json_values,
        "other": json_values,
    },
)


def stream(text: str, cuts: list[int], schema: Any = SCHEMA) -> tuple[str, str, JsonStreamer]:
    streamer = JsonStreamer(schema)
    fragments, leftover, pos = [], "", 0
    for cut in sorted(set(cuts)) + [len(text)]:
        fragment, rest = streamer.feed(text[pos:cut])
        fragments.append(fragment)
        leftover += rest
        pos = cut
    return "".join(fragments), leftover, streamer


@settings(max_examples=300, deadline=None)
@given(argument_objects, st.data(), st.sampled_from([None, 2]))
def test_any_chunking_gives_the_coerced_value(
    arguments: dict, data: st.DataObject, indent: int | None
) -> None:
    text = json.dumps(arguments, ensure_ascii=data.draw(st.booleans()), indent=indent) + "} tail"
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=20))
    whole, _, _ = stream(text, [])
    result, leftover, streamer = stream(text, cuts)
    assert streamer.done and not streamer.failed
    assert result == whole
    assert json.loads(result) == coerce(arguments, SCHEMA)
    assert leftover == "} tail"


def test_held_values_wait_until_complete() -> None:
    streamer = JsonStreamer(SCHEMA)
    emitted = [streamer.feed(piece)[0] for piece in ['{"days": "1', '2", "city": "Be', 'rn"}']]
    assert emitted == ['{"days": ', '12, "city": "Be', 'rn"}']


@pytest.mark.parametrize(
    "text,closed",
    [
        ('{"city": "Pa', '{"city": "Pa"}'),
        ('{"days": 3', '{"days": 3}'),
        ('{"days": "3', '{"days": 3}'),
        ('{"hours": [1, 2', '{"hours": [1, 2]}'),
        ('{"city":', '{"city": null}'),
        ('{"cit', "{}"),
        ("", "{}"),
    ],
)
def test_close_repairs_missing_closers(text: str, closed: str) -> None:
    streamer = JsonStreamer(SCHEMA)
    fragment, _ = streamer.feed(text)
    result = fragment + streamer.close()
    assert result == closed
    json.loads(result)


def test_control_characters_and_escapes_stay_valid_json() -> None:
    text = '{"city": "a\tb\nc \\"q\\" \\u00e9 \\x"}'
    result, _, streamer = stream(text, list(range(len(text))))
    assert json.loads(result) == {"city": 'a\tb\nc "q" é \\x'}


def test_failure_keeps_the_raw_text() -> None:
    result, _, streamer = stream('{"city": "x" ] garbage', [5])
    assert streamer.failed
    assert result + streamer.raw_tail() == '{"city": "x"] garbage'


@pytest.mark.parametrize(
    "text,schema,value",
    [
        ("3", {"type": "integer"}, 3),
        ("3.0", {"type": "number"}, 3.0),
        ("True", {"type": "boolean"}, True),
        ("[1, 2]", {"type": "array"}, [1, 2]),
        ("null", {"type": ["string", "null"]}, None),
        ("007", {"type": "string"}, "007"),
        ("plain words", None, "plain words"),
        ('{"a": "1"}', {"type": "object", "properties": {"a": {"type": "integer"}}}, {"a": 1}),
    ],
)
def test_coerce_text_value(text: str, schema: Any, value: Any) -> None:
    assert coerce_text_value(text, schema) == value


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="<>/abt_|", max_size=40), st.lists(st.integers(0, 40), max_size=6))
def test_marker_split_is_tokenization_invariant(text: str, cuts: list[int]) -> None:
    markers = MarkerSet(["<tool_call>", "</tool_call>", "<|a|>"])
    from pipeserve.stages.toolfmt.markers import Splitter

    def parts(pieces: list[str]) -> list[str]:
        splitter, out = Splitter(), [""]
        for piece in pieces:
            buf = splitter.take(piece)
            while buf:
                before, marker, after = splitter.split(buf, markers)
                out[-1] += before
                if marker is None:
                    splitter.held = after
                    break
                out += [marker, ""]
                buf = after
        out[-1] += splitter.flush()
        return out

    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)])]
    assert parts(pieces) == parts([text])
    assert "".join(parts(pieces)) == text
