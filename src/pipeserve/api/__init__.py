"""Wire protocols: `load_builtin_protocols()` imports the built-in protocol modules, which
register themselves (importing this package alone registers nothing). See docs/extending.md."""

from __future__ import annotations

import importlib

from pipeserve.api.base import PROTOCOL_REGISTRY, RequestMeta, WireProtocol, register_protocol

PROTOCOL_MODULES: tuple[str, ...] = (
    "openai_chat",
    "anthropic_messages",
    "openai_responses",
    "openai_completions",
    "ollama",
)


def load_builtin_protocols() -> dict[str, type[WireProtocol]]:
    for module in PROTOCOL_MODULES:
        importlib.import_module(f"pipeserve.api.{module}")
    return PROTOCOL_REGISTRY


__all__ = [
    "PROTOCOL_MODULES",
    "PROTOCOL_REGISTRY",
    "RequestMeta",
    "WireProtocol",
    "load_builtin_protocols",
    "register_protocol",
]
