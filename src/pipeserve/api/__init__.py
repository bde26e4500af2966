"""Wire protocols: `load_builtin_protocols()` imports each built-in protocol package's
`protocol` module, which registers itself (importing this package, or a protocol package,
alone registers nothing). Every protocol package has the same modules (schema, decode,
encode, fold, protocol); see docs/architecture.md "Protocols" and docs/extending.md."""

from __future__ import annotations

import importlib

from pipeserve.api.base import PROTOCOL_REGISTRY, RequestMeta, WireProtocol, register_protocol

PROTOCOL_MODULES: tuple[str, ...] = (
    "openai_chat",
    "anthropic_messages",
    "openai_responses",
    "openai_completions",
    "ollama",
    "llama_cpp",
)


def load_builtin_protocols() -> dict[str, type[WireProtocol]]:
    for package in PROTOCOL_MODULES:
        importlib.import_module(f"pipeserve.api.{package}.protocol")
    return PROTOCOL_REGISTRY


__all__ = [
    "PROTOCOL_MODULES",
    "PROTOCOL_REGISTRY",
    "RequestMeta",
    "WireProtocol",
    "load_builtin_protocols",
    "register_protocol",
]
