"""The non-streaming Response object: the fold of the stream events ResponseEvents
(encode.py) produces, which is the `response` of the last one (`response.completed` or
`response.incomplete`; a failure is raised by the shared base before it)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pipeserve.api.framing import Frame


def fold_response(frames: Iterable[Frame]) -> dict[str, Any]:
    last = list(frames)[-1].data
    assert isinstance(last, dict)
    response: dict[str, Any] = last["response"]
    return response


__all__ = ["fold_response"]
