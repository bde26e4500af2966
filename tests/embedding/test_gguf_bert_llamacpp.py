"""A BERT GGUF (llama.cpp's `bert` architecture, as its converter writes all-MiniLM / bge
/ e5 files) served as an embedding model, against llama.cpp's embedding mode on the same
file (llama-cpp-python, tests/engine/weights/llamacpp_worker.py): the WordPiece token ids
equal llama.cpp's for a corpus with punctuation, whitespace runs, CJK, accents, emoji and
digits, and each sentence's vector agrees, for mean and CLS pooling, normalised and not.

The weights are random (tests/embedding/gguf_bert.py); matrices as F16 and as Q8_0.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from pipeserve.config.models import EmbeddingOptions, EngineOptions, ModelEntry
from pipeserve.engine.base import ModelRuntime
from pipeserve.engine.embedding.engine import EmbeddingEngine
from pipeserve.engine.embedding.inputs import InputTokenizer
from pipeserve.engine.embedding.jobs import EmbedJob
from pipeserve.engine.embedding.runtime import build_embedding_runtime
from pipeserve.engine.weights.gguf.inspect import inspect_gguf
from tests.embedding.gguf_bert import write_bert_gguf
from tests.embedding.models import chain_vectors
from tests.embedding.reference import SENTENCES, cosine
from tests.engine.weights.llamacpp import run_llama_job

pytestmark = [pytest.mark.llamacpp, pytest.mark.mlx]

EDGE_TEXTS = [
    "Hello,   world!!  (tabs\tand\nnewlines)",
    "Café naïve résumé: accents go (NFD, combining marks dropped)",
    "中文字符 and 日本語 mixed with English",
    "emoji 🙂 and symbols $5 + 3 = 8 ~ok~ a|b",
    "UPPER lower MiXeD 12345 3.14 e-mail@example.org",
]
TEXTS = SENTENCES + EDGE_TEXTS
# Measured on the corpus (cosine min; un-normalised length off by at most): F16 matrices
# 1.000000 (mean 0.014 %, cls 0.001 %); Q8_0 matrices (llama.cpp rounds the activations
# to 8 bits, pipeserve multiplies the dequantized weights in float32) 0.999989, 0.11 %.
# The bounds leave about twice the measured gap.
COSINE, NORM = 0.99997, 0.003
CASES = [
    ("bert", GGMLQuantizationType.F16, "mean"),
    ("bert", GGMLQuantizationType.F16, "cls"),
    ("bert", GGMLQuantizationType.Q8_0, "mean"),
    ("nomic-bert", GGMLQuantizationType.F16, "mean"),
    ("nomic-bert", GGMLQuantizationType.Q8_0, "mean"),
]
POOLING_TYPE = {"mean": 1, "cls": 2}


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{t.name}-{p}" for a, t, p in CASES])
def case(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, str, dict[str, object]]:
    arch, kind, pooling = request.param
    work = tmp_path_factory.mktemp(f"{arch}-{kind.name}-{pooling}")
    gguf = write_bert_gguf(work / "bert.gguf", TEXTS, kind, POOLING_TYPE[pooling], arch=arch)
    job = {"command": "embed", "gguf": str(gguf), "texts": TEXTS, "poolings": [pooling]}
    return gguf, pooling, run_llama_job(job, work)


def runtime_of(gguf: Path, home: Path, normalize: bool) -> ModelRuntime:
    from pipeserve.engine.weights.gguf import ensure_converted

    folder = ensure_converted(gguf, home)  # a home of this test's own: never a stale folder
    entry = ModelEntry(
        name="bert-gguf",
        source=str(gguf),
        kind="embedding",
        options=EngineOptions(max_batch=8, queue_size=0),
        embedding=EmbeddingOptions(normalize=normalize),
    )
    return build_embedding_runtime(entry, folder)


@pytest.fixture(scope="module", params=[False, True], ids=["raw", "unit"])
def served(
    request: pytest.FixtureRequest,
    case: tuple[Path, str, dict[str, object]],
) -> Iterator[tuple[bool, ModelRuntime]]:
    runtime = runtime_of(case[0], case[0].parent, request.param)
    yield request.param, runtime
    runtime.engine.close()


def test_bert_gguf_matches_llama_cpp(
    case: tuple[Path, str, dict[str, object]], served: tuple[bool, ModelRuntime]
) -> None:
    _, pooling, reference = case
    normalize, runtime = served
    assert isinstance(runtime.tokenizer, InputTokenizer)
    assert isinstance(runtime.engine, EmbeddingEngine)
    assert runtime.embedding is not None and runtime.embedding.pooling == pooling
    sequences = runtime.tokenizer.texts(TEXTS, "input", False)
    assert [s.ids for s in sequences] == reference["ids"]
    result = runtime.engine.embed(EmbedJob("t", sequences)).wait(120)
    assert result is not None and result.error is None
    ours = chain_vectors(result.vectors, runtime.embedding)
    theirs = reference[pooling]["normalized" if normalize else "raw"]  # type: ignore[index]
    cosines, norms = [], []
    for mine, vector in zip(ours, theirs, strict=True):
        expected = np.array(vector, dtype=np.float32)
        cosines.append(cosine(mine, expected))
        norms.append(abs(float(np.linalg.norm(mine) / np.linalg.norm(expected)) - 1.0))
    worst = int(np.argmin(cosines))
    print(
        f"{pooling} normalize={normalize}: min cosine {cosines[worst]:.6f}, norm {max(norms):.4%}"
    )
    assert cosines[worst] >= COSINE, f"{TEXTS[worst]!r}: cosine {cosines[worst]:.5f}"
    assert max(norms) <= NORM, f"lengths differ by up to {max(norms):.2%}"


def test_bert_gguf_explains_itself(tmp_path: Path) -> None:
    gguf = write_bert_gguf(tmp_path / "b.gguf", SENTENCES[:3], GGMLQuantizationType.F16)
    summary = inspect_gguf(gguf)
    assert summary.architecture == "bert" and summary.model_type == "bert"
    assert summary.encoder and summary.kv_bytes_per_token == 0
    lines = summary.lines()
    assert "chat template: none (an embedding model)" in lines
    assert any(line.endswith("MiB (float32), no KV cache") for line in lines)


def test_a_bert_gguf_with_unknown_tensors_is_refused_by_name(tmp_path: Path) -> None:
    """A classifier head (a reranker's `cls.*` tensors) is not converted: validate and
    load say which tensor, never a traceback."""
    from gguf import GGUFReader, GGUFWriter

    from pipeserve.engine.weights.gguf.files import GgufError

    plain = write_bert_gguf(tmp_path / "b.gguf", SENTENCES[:3], GGMLQuantizationType.F16)
    reader = GGUFReader(str(plain))
    writer = GGUFWriter(str(tmp_path / "cls.gguf"), "bert")
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            writer.add_key_value(field.name, field.contents(), field.types[0],
                                 field.types[-1] if len(field.types) > 1 else None)  # fmt: skip
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensor.data))
    writer.add_tensor("cls.output.weight", np.zeros((1, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GgufError, match=r"cls\.gguf: tensor cls\.output\.weight is not known"):
        inspect_gguf(tmp_path / "cls.gguf")
