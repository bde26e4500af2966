"""The registered llama.cpp server protocol (`api: llama-cpp`, conventionally on `/`):
`<route>/infill` generates (decode.py, encode.py, fold.py, on the shared base
api/framing.py); `<route>/tokenize` and `<route>/detokenize` are served by the server
(server/tokenize.py) in this protocol's shapes:

    POST /tokenize   {"content": "text", "add_special": false, "parse_special": true,
                      "with_pieces": false}            -> {"tokens": [ids]}
                     {"messages": [...chat...]}        -> {"tokens": [ids]}
                     with_pieces: {"tokens": [{"id": 1, "piece": "text" or [bytes]}]}
    POST /detokenize {"tokens": [ids]}                 -> {"content": "text"}

Errors are llama.cpp's `{"error": {"code", "message", "type"}}` plus `param`, the field.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

from pipeserve.api.base import RequestMeta, WireProtocol, register_protocol
from pipeserve.api.framing import json_frames, sse_frames
from pipeserve.api.llama_cpp.decode import decode_detokenize, decode_infill, decode_tokenize
from pipeserve.api.llama_cpp.encode import CompletionObjects, llama_error_body
from pipeserve.api.llama_cpp.fold import fold_objects
from pipeserve.api.openai_common import close_events
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError
from pipeserve.events import Event
from pipeserve.request import DetokenizeRequest, GenerationRequest, TokenizeRequest


@register_protocol
class LlamaCpp(WireProtocol):
    name: ClassVar[str] = "llama-cpp"
    generation_paths: ClassVar[tuple[str, ...]] = ("/infill",)
    token_paths: ClassVar[Mapping[str, str]] = {
        "/tokenize": "tokenize",
        "/detokenize": "detokenize",
    }
    model_optional: ClassVar[bool] = True

    def decode(self, body: Any, meta: RequestMeta) -> GenerationRequest:
        return decode_infill(body)

    def encode_json(self, events: Iterator[Event], ctx: RequestContext) -> dict[str, Any]:
        try:
            return fold_objects(json_frames(CompletionObjects(ctx), events, ctx), ctx)
        finally:
            close_events(events)

    def encode_stream(self, events: Iterator[Event], ctx: RequestContext) -> Iterator[bytes]:
        try:
            yield from sse_frames(CompletionObjects(ctx), events, ctx)
        finally:
            close_events(events)

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return llama_error_body(error, self.error_status(error))

    def tokenize_body(self, body: Any) -> TokenizeRequest:
        return decode_tokenize(body)

    def tokenize_response(self, tokens: list[int], pieces: list[Any] | None) -> dict[str, Any]:
        if pieces is None:
            return {"tokens": tokens}
        return {"tokens": [{"id": t, "piece": p} for t, p in zip(tokens, pieces, strict=True)]}

    def detokenize_body(self, body: Any) -> DetokenizeRequest:
        return decode_detokenize(body)

    def detokenize_response(self, text: str) -> dict[str, Any]:
        return {"content": text}


__all__ = ["LlamaCpp"]
