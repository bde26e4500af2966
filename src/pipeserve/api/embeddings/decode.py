"""Bodies -> protocol-neutral embedding and rerank requests (400s name the field)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pipeserve.api.embeddings.schema import (
    OllamaEmbedIn,
    OllamaLegacyEmbeddingsIn,
    OpenAIEmbeddingsIn,
    RerankIn,
)
from pipeserve.api.openai_common import validate
from pipeserve.errors import invalid

Shape = Literal["openai", "ollama", "ollama-legacy", "rerank"]


@dataclass
class EmbedRequest:
    model: str
    field: str  # the body's name for the inputs (errors name it)
    texts: list[str] | None = None
    token_arrays: list[list[int]] | None = None
    single: bool = False  # one input, not a list
    dimensions: int | None = None
    encoding_format: Literal["float", "base64"] = "float"
    truncate: bool = False

    @property
    def count(self) -> int:
        return len(self.texts if self.texts is not None else self.token_arrays or [])


@dataclass
class RerankRequest:
    model: str
    query: str
    documents: list[str]
    top_n: int | None
    return_documents: bool
    truncate: bool


def decode_embed(shape: Shape, body: Any) -> EmbedRequest:
    if shape == "openai":
        return _openai(validate(OpenAIEmbeddingsIn, body))
    if shape == "ollama":
        req = validate(OllamaEmbedIn, body)
        single = isinstance(req.input, str)
        texts = [req.input] if isinstance(req.input, str) else req.input
        return _nonempty(EmbedRequest(req.model, "input", texts=texts, single=single,
                                      dimensions=req.dimensions, truncate=req.truncate))  # fmt: skip
    legacy = validate(OllamaLegacyEmbeddingsIn, body)
    return _nonempty(
        EmbedRequest(legacy.model, "prompt", texts=[legacy.prompt], single=True, truncate=True)
    )


def _openai(req: OpenAIEmbeddingsIn) -> EmbedRequest:
    out = EmbedRequest(req.model, "input", dimensions=req.dimensions,
                       encoding_format=req.encoding_format, truncate=req.truncate)  # fmt: skip
    value = req.input
    if isinstance(value, str):
        out.texts, out.single = [value], True
    elif value and all(isinstance(v, int) for v in value):
        out.token_arrays, out.single = [[v for v in value if isinstance(v, int)]], True
    elif value and all(isinstance(v, list) for v in value):
        out.token_arrays = [v for v in value if isinstance(v, list)]
    else:
        out.texts = [v for v in value if isinstance(v, str)]
    return _nonempty(out)


def _nonempty(request: EmbedRequest) -> EmbedRequest:
    if request.count == 0:
        raise invalid(f"'{request.field}' must not be empty.", request.field)
    return request


def decode_rerank(body: Any) -> RerankRequest:
    req = validate(RerankIn, body)
    if not req.query:
        raise invalid("'query' must not be empty.", "query")
    if not req.documents:
        raise invalid("'documents' must not be empty.", "documents")
    documents = [d if isinstance(d, str) else d.text for d in req.documents]
    for i, text in enumerate(documents):
        if not text:
            raise invalid(f"'documents[{i}]' must not be empty.", f"documents[{i}]")
    return RerankRequest(
        req.model, req.query, documents, req.top_n, req.return_documents, req.truncate
    )
