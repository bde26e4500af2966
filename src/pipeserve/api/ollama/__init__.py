"""Ollama's API (`api: ollama`), in the layout every protocol package shares
(docs/architecture.md "Protocols"): schema.py (request models), decode.py (body ->
OllamaGenerationRequest), encode.py (events -> NDJSON objects), fold.py (objects -> the
`stream: false` object), protocol.py (the registered WireProtocol). catalog.py answers
/tags, /show and /ps. Importing this package registers nothing."""
