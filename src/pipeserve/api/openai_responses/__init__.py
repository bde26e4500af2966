"""OpenAI Responses (`api: openai-responses`), in the layout every protocol package
shares (docs/architecture.md "Protocols"): schema.py (request models), decode.py
(body -> ResponsesGenerationRequest), encode.py (events -> stream events), fold.py
(stream events -> the Response object), protocol.py (the registered WireProtocol).
state.py resolves and keeps stored responses; replay.py streams a stored one again.
Importing this package registers nothing."""
