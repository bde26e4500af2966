"""OpenAI Chat Completions (`api: openai-chat`), in the layout every protocol package
shares (docs/architecture.md "Protocols"): schema.py (request models), decode.py
(body -> ChatGenerationRequest), encode.py (events -> chunks), fold.py (chunks -> the
`chat.completion` body), protocol.py (the registered WireProtocol). template_kwargs.py
checks Chat's `chat_template_kwargs`. Importing this package registers nothing."""
