"""Legacy OpenAI Completions (`api: openai-completions`), in the layout every protocol
package shares (docs/architecture.md "Protocols"): schema.py (request models), decode.py
(body -> CompletionGenerationRequest), encode.py (events -> `text_completion` chunks),
fold.py (chunks -> the non-streaming body), protocol.py (the registered WireProtocol).
Importing this package registers nothing."""
