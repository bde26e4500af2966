"""The non-streaming completion object: the fold of the objects CompletionObjects
(encode.py) produces, their contents joined into the final object. An error object
never reaches it: the shared base raises its ApiError (api/framing.py `json_frames`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pipeserve.api.framing import Frame
from pipeserve.api.openai_common import cancelled_error
from pipeserve.context import RequestContext


def fold_objects(frames: Iterable[Frame], ctx: RequestContext) -> dict[str, Any]:
    texts: list[str] = []
    for frame in frames:
        chunk = frame.data
        assert isinstance(chunk, dict), "llama.cpp's objects are all JSON objects"
        texts.append(chunk["content"])
        if chunk["stop"]:
            return {**chunk, "content": "".join(texts)}
    raise cancelled_error(ctx)


__all__ = ["fold_objects"]
