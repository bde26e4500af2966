"""The embeddings and rerank wire shapes: OpenAI `/v1/embeddings`, Ollama `/api/embed`
and `/api/embeddings`, and `/v1/rerank` as Jina, Cohere and llama.cpp answer it.

    schema.py  pydantic models of the bodies
    decode.py  body -> EmbedRequest / RerankRequest (protocol-neutral)
    encode.py  results -> each shape's JSON body

These are not WireProtocols (no event stream, no stage chain): server/embeddings.py
serves them, with the OpenAI or Ollama error shape (docs/embeddings.md)."""
