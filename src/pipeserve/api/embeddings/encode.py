"""Results -> each shape's JSON body."""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

import numpy as np

from pipeserve.api.embeddings.decode import EmbedRequest, RerankRequest, Shape


def _vector(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":  # little-endian float32, as OpenAI sends it
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    values: list[float] = vector.astype(np.float32).tolist()
    return values


def encode_embeddings(
    shape: Shape, request: EmbedRequest, model: str, vectors: list[np.ndarray], tokens: int,
    seconds: float,
) -> dict[str, Any]:  # fmt: skip
    if shape == "openai":
        return {
            "object": "list",
            "data": [
                {
                    "object": "embedding",
                    "index": i,
                    "embedding": _vector(v, request.encoding_format),
                }
                for i, v in enumerate(vectors)
            ],
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    if shape == "ollama-legacy":
        return {"embedding": _vector(vectors[0], "float")}
    return {
        "model": model,
        "embeddings": [_vector(v, "float") for v in vectors],
        "total_duration": int(seconds * 1e9),
        "load_duration": 0,
        "prompt_eval_count": tokens,
    }


def encode_rerank(
    request: RerankRequest, model: str, scores: list[float], tokens: int
) -> dict[str, Any]:
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    if request.top_n is not None:
        order = order[: request.top_n]
    results = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if request.return_documents:
            item["document"] = {"text": request.documents[i]}
        results.append(item)
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "object": "list",
        "model": model,
        "created": int(time.time()),
        "results": results,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
