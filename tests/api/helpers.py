"""The shared harness of the protocol tests (tests/api).

Every test file builds its requests, contexts, in-process SDK clients, SSE parsing and
pipelines from here, instead of each keeping its own copy; the shared behaviour of all
protocols is checked once, over the protocol registry, in test_protocol_conformance.py.

- `MINIMAL`, `protocol`, `decode`, `ctx_for`: a registered protocol, its smallest request,
  and the per-request context the encoders read.
- `InProcess`: an httpx handler that runs a protocol in process (decode -> a scripted
  event list standing in for the model -> encode, errors in the protocol's own shape),
  so that the official SDKs (`openai_client`, `anthropic_client`, `ollama_client`) build
  the requests and parse our answers.
- `parse_sse`, `openai_stream`, `data_frames`, `final_via_sdk`, `anthropic_events`,
  `anthropic_message`: our bytes read the way the SDKs read them.
- `family_chain`, `replay_events`, `token_events`: the real stages of a demo family's
  pipeline (pipelines/*.yaml), fed by the replay engine (exact model output through the
  family's real tokenizer) or by scripted token text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import anthropic
import httpx
import httpx2
import ollama
from anthropic._streaming import SSEDecoder
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message as AnthropicMessage
from openai import OpenAI, Stream, omit
from openai.lib.streaming.responses import ResponseStream
from openai.types.responses import ResponseStreamEvent

from pipeserve.api import load_builtin_protocols
from pipeserve.api.base import RequestMeta, WireProtocol
from pipeserve.config import load_pipeline
from pipeserve.errors import ApiError
from pipeserve.events import Event, Finish, PromptReady, TokenText, Usage
from pipeserve.request import GenerationRequest
from pipeserve.stages.base import BuildEnv, Chain, RequestContext

REPO = Path(__file__).resolve().parents[2]
# A qwen3 answer with reasoning, text and one tool call, for the replay engine.
QWEN3_CALL = (
    "<think>\nPlan: call the tool.\n</think>\n\nSure.<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
USER = [{"role": "user", "content": "Hi there"}]
# The smallest request each registered protocol accepts, and the route it is served on.
MINIMAL: dict[str, tuple[str, dict[str, Any]]] = {
    "openai-chat": ("/v1/chat/completions", {"model": "m", "messages": USER}),
    "anthropic-messages": ("/v1/messages", {"model": "m", "max_tokens": 16, "messages": USER}),
    "openai-responses": ("/v1/responses", {"model": "m", "input": "Hi there"}),
    "openai-completions": ("/v1/completions", {"model": "m", "prompt": "Hi there"}),
    "ollama": ("/api/chat", {"model": "m", "messages": USER}),
    "llama-cpp": ("/infill", {"model": "m", "input_prefix": "def f(", "input_suffix": ")"}),
}
PROTOCOL_NAMES = sorted(load_builtin_protocols())


def protocol(name: str) -> WireProtocol:
    """A fresh instance of a registered protocol."""
    return load_builtin_protocols()[name]()


def decode(
    wire: WireProtocol, body: dict[str, Any], route: str | None = None, **meta: Any
) -> GenerationRequest:
    """`body` decoded by `wire` on `route` (default: the protocol's minimal-request route)."""
    return wire.decode(body, RequestMeta(route=route or MINIMAL[wire.name][0], **meta))


def minimal(name: str, **fields: Any) -> tuple[WireProtocol, GenerationRequest]:
    """A registered protocol and its minimal request, with `fields` added."""
    wire = protocol(name)
    return wire, decode(wire, {**MINIMAL[name][1], **fields})


def ctx_for(
    request: GenerationRequest, model: str = "demo", request_id: str = "req-1", **fields: Any
) -> RequestContext:
    """The per-request context an encoder reads (`fields`: e.g. prompt_token_ids)."""
    return RequestContext(request=request, request_id=request_id, model_name=model, **fields)


Script = Callable[[RequestContext], list[Event]]


class InProcess:
    """An httpx handler that runs `wire` in process: decode the SDK's body, take the
    events of `script` for it, encode them (SSE, NDJSON or JSON) or render the ApiError
    in the protocol's shape. `http` is the httpx flavour the SDK runs on (the openai and
    anthropic SDKs: httpx2; ollama: httpx). Protocols that count tokens answer
    `<route>/count_tokens` with `input_tokens`."""

    def __init__(
        self,
        wire: WireProtocol,
        script: Script | Sequence[Event],
        *,
        http: ModuleType = httpx2,
        model: str | None = "demo",
        request_id: str = "req-1",
        input_tokens: int = 42,
    ) -> None:
        self.wire = wire
        self.script = script  # may be replaced between requests
        self.http = http
        self.model = model
        self.request_id = request_id
        self.input_tokens = input_tokens
        self.seen: list[Any] = []  # the SDK's HTTP requests
        self.requests: list[GenerationRequest] = []
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: Any) -> Any:
        self.seen.append(request)
        body = json.loads(request.content) if request.content else None
        self.bodies.append(body)
        meta = RequestMeta(
            route=request.url.path, headers=dict(request.headers), query=dict(request.url.params)
        )
        try:
            if self.wire.counts_tokens and request.url.path.endswith("/count_tokens"):
                self.requests.append(self.wire.count_tokens_body(body, meta))
                return self.json(200, self.wire.count_tokens_response(self.input_tokens))
            gen = self.wire.decode(body, meta)
            self.requests.append(gen)
            ctx = ctx_for(gen, self.model or gen.model, self.request_id)
            script = self.script
            events = iter(script(ctx) if callable(script) else list(script))
            if gen.stream:
                raw = b"".join(self.wire.encode_stream(events, ctx))
                headers = {"content-type": self.wire.stream_content_type}
                return self.http.Response(200, content=raw, headers=headers)
            return self.json(200, self.wire.encode_json(events, ctx))
        except ApiError as err:
            return self.json(self.wire.error_status(err), self.wire.error_body(err))

    def json(self, status: int, body: dict[str, Any]) -> Any:
        return self.http.Response(status, json=body)


def openai_client(handler: InProcess) -> OpenAI:
    return OpenAI(
        api_key="test",
        base_url="http://test/v1",
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
        max_retries=0,
    )


def anthropic_client(handler: InProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        api_key="k",
        base_url="http://test",
        max_retries=0,
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
    )


def ollama_client(handler: InProcess) -> ollama.Client:
    """The ollama client over `handler` (which must be built with `http=httpx`)."""
    return ollama.Client(host="http://test", transport=httpx.MockTransport(handler))


class Harness(InProcess):
    """An in-process protocol with its openai SDK client (`.client`)."""

    def __init__(self, wire: WireProtocol, script: Script | Sequence[Event], **kw: Any) -> None:
        super().__init__(wire, script, **kw)
        self.client = openai_client(self)


# ---------------------------------------------------------------- reading our bytes


def parse_sse(raw: bytes) -> list[dict[str, Any]]:
    """Frames as dicts: {"event": name|None, "data": text|None, "comment": text|None}."""
    text = raw.decode()
    assert text.endswith("\n\n"), "every SSE frame ends with a blank line"
    frames = []
    for block in text[:-2].split("\n\n"):
        frame: dict[str, Any] = {"event": None, "data": None, "comment": None}
        for line in block.split("\n"):
            key, _, value = line.partition(":")
            frame["comment" if key == "" else key] = value.strip()
        frames.append(frame)
    return frames


def openai_stream(raw: bytes, cast_to: type[Any]) -> Stream[Any]:
    """The openai SDK's own SSE decoder and chunk parsing over our bytes."""
    client = OpenAI(api_key="test", base_url="http://test/v1")
    request = httpx2.Request("POST", "http://test/v1/x")
    headers = {"content-type": "text/event-stream"}
    response = httpx2.Response(200, content=raw, request=request, headers=headers)
    return Stream(cast_to=cast_to, response=response, client=client)


def anthropic_events(raw: bytes) -> list[tuple[str | None, dict[str, Any]]]:
    """(event name, data) of each SSE event, decoded by the anthropic SDK."""
    return [(item.event, item.json()) for item in SSEDecoder().iter_bytes(iter([raw]))]


def anthropic_message(events: list[tuple[str | None, dict[str, Any]]]) -> AnthropicMessage:
    """The message the anthropic SDK accumulates from these stream events."""
    snapshot = None
    bufs: dict[int, bytes] = {}
    for name, data in events:
        if name == "ping":
            continue
        snapshot = accumulate_event(event=data, current_snapshot=snapshot, json_bufs=bufs)  # type: ignore[arg-type]
    assert snapshot is not None
    return AnthropicMessage.model_validate(snapshot.model_dump())


def data_frames(raw: bytes) -> list[dict[str, Any]]:
    """A Responses stream's events; each `event:` line must match its payload's type."""
    frames = [f for f in parse_sse(raw) if f["data"] is not None]
    for frame in frames:
        assert frame["event"] == json.loads(frame["data"])["type"]
    return [json.loads(f["data"]) for f in frames]


def final_via_sdk(raw: bytes, tools: Any = omit) -> Any:
    """The Response the openai SDK's ResponseStream accumulates from a Responses stream."""
    stream = ResponseStream(
        raw_stream=openai_stream(raw, ResponseStreamEvent),  # type: ignore[arg-type]
        text_format=omit,
        input_tools=tools,
        starting_after=None,
    )
    return stream.get_final_response()


# ---------------------------------------------------------------- real pipelines


def family_chain(family: str, runtime: Any = None, transforms_only: bool = False) -> Chain:
    """The stages of pipelines/<family>.yaml, built as the server builds them.
    `transforms_only`: without render and generate (fed by `token_events` instead)."""
    pipeline = load_pipeline(REPO / "pipelines" / f"{family}.yaml")
    env = BuildEnv(model_name=f"replay-{family}", family=family, runtime=runtime)
    stages = [s for s in pipeline.stages if not transforms_only or s.role == "transform"]
    return Chain([s.spec.factory(s.params, env) for s in stages], [s.role for s in stages])


def replay_events(
    runtime: Any,
    wire: WireProtocol,
    body: dict[str, Any],
    route: str | None = None,
    family: str = "qwen3",
) -> tuple[Iterator[Event], RequestContext]:
    """Decode `body` with `wire`, then run the family's real pipeline on the replay
    engine (`runtime`), which streams `mock_response` through the real tokenizer."""
    chain = family_chain(family, runtime)
    ctx = ctx_for(decode(wire, body, route), f"replay-{family}", "req_e2e")
    chain.prepare(ctx)
    return chain.run(ctx), ctx


def split(text: str, size: int) -> list[str]:
    """`text` cut into pieces of `size` characters (token-sized splits)."""
    return [text[start : start + size] for start in range(0, len(text), size)]


def token_events(
    pieces: Sequence[str], ctx: RequestContext, prompt: PromptReady | None = None
) -> Iterator[Event]:
    """What generate emits for output `pieces`: PromptReady, one TokenText per piece
    (stopping early once cancelled), Finish, Usage."""
    prompt = prompt or PromptReady(50, 16)
    yield prompt
    count = 0
    for piece in pieces:
        if ctx.cancelled:
            yield Finish("cancelled")
            break
        count += 1
        yield TokenText(piece, token_id=1000 + count)
    else:
        yield Finish("stop")
    yield Usage(prompt.prompt_tokens, count + 1, prompt.cached_tokens)


def scripted_pipeline(
    family: str,
    wire: WireProtocol,
    body: dict[str, Any],
    pieces: Sequence[str],
    prompt: PromptReady | None = None,
) -> tuple[Iterator[Event], RequestContext]:
    """Decode `body`, then run the family's transform stages over the output `pieces`."""
    chain = family_chain(family, transforms_only=True)
    ctx = ctx_for(decode(wire, body), "demo", "req_pipe")
    chain.prepare(ctx)
    events: Iterator[Event] = token_events(pieces, ctx, prompt)
    for stage, _ in chain.used(ctx):
        events = stage(events, ctx)
    return events, ctx


# A qwen3 weather tool call, as the real qwen3 stages see it (Chat and Responses tests).
QWEN3_WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
}
# qwen3-style output, split into the pieces a tokenizer would produce (markers are single tokens)
QWEN3_PIECES = [
    "<think>",
    "\n",
    "Need",
    " weather",
    ".\n",
    "</think>",
    "\n\n",
    "<tool_call>",
    "\n",
    '{"name": "get',
    '_weather", "arguments": {"city": "Os',
    'lo", "days": "3"}}',
    "\n",
    "</tool_call>",
]
