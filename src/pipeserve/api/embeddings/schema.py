"""Pydantic models of the embeddings and rerank bodies. Unknown fields are accepted
and ignored (clients send `user`, `options`, `keep_alive`...); types are strict."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeserve.api.openai_common import Lenient


class OpenAIEmbeddingsIn(Lenient):
    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    truncate: bool = False  # an extension (llama.cpp, vLLM): cut long inputs


class OllamaEmbedIn(Lenient):
    model: str = Field(min_length=1)
    input: str | list[str]
    truncate: bool = True  # Ollama's default: long inputs are cut
    dimensions: int | None = Field(None, ge=1)


class OllamaLegacyEmbeddingsIn(Lenient):
    model: str = Field(min_length=1)
    prompt: str


class DocumentIn(Lenient):
    text: str


class RerankIn(Lenient):
    model: str = Field(min_length=1)
    query: str
    documents: list[str] | list[DocumentIn]
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = False
    truncate: bool = False
