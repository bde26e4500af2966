"""Per-token cost of each protocol's encoder: the streamed body and the non-streamed (JSON)
answer of N content deltas, plus a reasoning lead-in, for every registered protocol.

Scripted pipeline events go straight to the protocol (no stages, no model), so the number
is the encoder alone: microseconds per token, streamed and JSON. Protocols come from the
registry, so the same script measures any tree (e.g. before and after an encoder change).

    python benchmarks/encode_bench.py [--tokens 1000,10000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from pipeserve.api import load_builtin_protocols
from pipeserve.api.base import RequestMeta, WireProtocol
from pipeserve.context import RequestContext
from pipeserve.events import ContentDelta, Event, Finish, PromptReady, ReasoningDelta, Usage

USER = [{"role": "user", "content": "Hi there"}]
REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "openai-chat": ("/v1/chat/completions", {"model": "m", "messages": USER}),
    "anthropic-messages": (
        "/v1/messages",
        {
            "model": "m",
            "max_tokens": 16,
            "messages": USER,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
        },
    ),
    "openai-responses": ("/v1/responses", {"model": "m", "input": "Hi there"}),
    "openai-completions": ("/v1/completions", {"model": "m", "prompt": "Hi there"}),
    "ollama": ("/api/chat", {"model": "m", "messages": USER}),
}


def script(tokens: int) -> list[Event]:
    lead = [ReasoningDelta(" thought") for _ in range(tokens // 10)]
    body = [ContentDelta(" word") for _ in range(tokens - len(lead))]
    return [PromptReady(10), *lead, *body, Finish("stop"), Usage(10, tokens)]


def best_of(repeat: int, run: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def timed(
    protocol: WireProtocol, name: str, events: list[Event], repeat: int
) -> tuple[float, float]:
    route, body = REQUESTS[name]

    def ctx(stream: bool) -> RequestContext:
        request = protocol.decode(dict(body, stream=stream), RequestMeta(route=route))
        return RequestContext(request=request, request_id="req_bench", model_name="m")

    def stream() -> object:
        return b"".join(protocol.encode_stream(iter(events), ctx(True)))

    def json_body() -> object:
        return protocol.encode_json(iter(events), ctx(False))

    return best_of(repeat, stream), best_of(repeat, json_body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1000,10000")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    protocols = load_builtin_protocols()
    print(f"{'protocol':20} {'tokens':>7} {'stream':>10} {'json':>10}  (us/token)")
    for name in sorted(protocols):
        for tokens in (int(n) for n in args.tokens.split(",")):
            stream, json_body = timed(protocols[name](), name, script(tokens), args.repeat)
            print(
                f"{name:20} {tokens:7d} {stream / tokens * 1e6:10.2f} {json_body / tokens * 1e6:10.2f}"
            )


if __name__ == "__main__":
    main()
