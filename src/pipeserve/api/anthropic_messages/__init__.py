"""Anthropic Messages (`api: anthropic-messages`), in the layout every protocol package
shares (docs/architecture.md "Protocols"): schema.py (request models), decode.py
(body -> AnthropicGenerationRequest), encode.py (events -> stream events), fold.py
(stream events -> the non-streaming message), protocol.py (the registered WireProtocol,
with count_tokens). Importing this package registers nothing."""
