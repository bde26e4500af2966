"""all-MiniLM-L6-v2 (a real sentence-transformers model from a registry wheel) through
the embedding engine: its vectors match an independent numpy BERT within cosine 0.999
for 50 sentences, pooling and normalisation come from the folder's own files, batching
and padding change nothing, and admission, cancellation and limits hold."""

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
from pipeserve.engine.embedding.spec import build_spec
from pipeserve.errors import ApiError
from tests.embedding.models import chain_vectors
from tests.embedding.reference import SENTENCES, NumpyBert, cosine


@pytest.fixture(scope="module")
def runtime(minilm_dir: Path) -> Iterator[ModelRuntime]:
    entry = ModelEntry(
        name="minilm",
        source=str(minilm_dir),
        kind="embedding",
        options=EngineOptions(max_batch=1, queue_size=0),
        # small batches: the test process multiplies with MLX's bundled reference BLAS
        # (servers preload OpenBLAS), and a cancel is applied between two batches
        embedding=EmbeddingOptions(batch_tokens=128),
    )
    built = build_embedding_runtime(entry, minilm_dir)
    yield built
    built.engine.close()


def embed(
    runtime: ModelRuntime, texts: list[str], dimensions: int | None = None
) -> list[np.ndarray]:
    assert isinstance(runtime.tokenizer, InputTokenizer)
    assert isinstance(runtime.engine, EmbeddingEngine)
    job = EmbedJob("t", runtime.tokenizer.texts(texts, "input", False))
    result = runtime.engine.embed(job).wait(60)
    assert result is not None and result.error is None and runtime.embedding is not None
    return chain_vectors(result.vectors, runtime.embedding, dimensions)


def test_spec_comes_from_the_folder(minilm_dir: Path) -> None:
    spec = build_spec(minilm_dir, EmbeddingOptions(), decoder=False, hidden_size=384)
    assert (spec.pooling, spec.normalize, spec.dimensions, spec.max_length) == (
        "mean",
        True,
        384,
        256,
    )
    yaml = EmbeddingOptions(pooling="cls", normalize=False, max_length=64)
    spec = build_spec(minilm_dir, yaml, decoder=False, hidden_size=384)
    assert (spec.pooling, spec.normalize, spec.max_length) == ("cls", False, 64)


def test_fifty_sentences_match_the_numpy_reference(runtime: ModelRuntime, minilm_dir: Path) -> None:
    assert len(SENTENCES) == 50
    reference = NumpyBert(minilm_dir)
    assert isinstance(runtime.tokenizer, InputTokenizer)
    sequences = runtime.tokenizer.texts(SENTENCES, "input", False)
    vectors = embed(runtime, SENTENCES)  # one request: batched and padded by length
    for text, seq, vector in zip(SENTENCES, sequences, vectors, strict=True):
        assert seq.ids[0] == 101 and seq.ids[-1] == 102  # [CLS] ... [SEP]
        expected = reference.embed(seq.ids)
        assert cosine(vector, expected) >= 0.999, text
        assert abs(float(np.linalg.norm(vector)) - 1.0) < 1e-5
    # sentence-transformers' published first values for "hello world"
    hello = embed(runtime, ["hello world"])[0]
    assert np.allclose(hello[:3], [-0.0344773, 0.0310232, 0.0067349], atol=1e-5)


def test_batching_and_padding_change_nothing(runtime: ModelRuntime) -> None:
    together = embed(runtime, SENTENCES[:12])
    alone = [embed(runtime, [text])[0] for text in SENTENCES[:12]]
    for a, b in zip(together, alone, strict=True):
        assert cosine(a, b) > 0.99999


def test_similar_sentences_are_closer(runtime: ModelRuntime) -> None:
    movie, great, pasta = embed(runtime, [SENTENCES[3], SENTENCES[6], SENTENCES[2]])
    assert cosine(movie, great) > cosine(movie, pasta) + 0.3


def test_matryoshka_cut_is_renormalised(runtime: ModelRuntime) -> None:
    full, cut = embed(runtime, ["hello world"])[0], embed(runtime, ["hello world"], 64)[0]
    assert cut.shape == (64,) and abs(float(np.linalg.norm(cut)) - 1.0) < 1e-5
    assert np.allclose(cut, full[:64] / np.linalg.norm(full[:64]), atol=1e-6)


def test_full_engine_answers_429_and_a_cancelled_job_ends(runtime: ModelRuntime) -> None:
    """Capacity 1 (max_batch 1, queue_size 0): while a long job runs, the next is refused."""
    engine, tokenizer = runtime.engine, runtime.tokenizer
    assert isinstance(engine, EmbeddingEngine) and isinstance(tokenizer, InputTokenizer)
    big = EmbedJob("big", tokenizer.texts(["a short sentence"] * 3000, "input", False))
    ticket = engine.embed(big)
    with pytest.raises(ApiError) as refused:
        engine.embed(EmbedJob("small", tokenizer.texts(["hi"], "input", False)))
    assert refused.value.kind == "overloaded" and refused.value.retry_after is not None
    ticket.cancel()
    result = ticket.wait(60)
    assert result is not None and result.error_kind == "cancelled" and not result.vectors
    assert engine.stats()["overloaded_total"] >= 1
    assert embed(runtime, ["hi again"])[0].shape == (384,)  # the place was freed


def test_limits_name_the_field(runtime: ModelRuntime) -> None:
    tokenizer = runtime.tokenizer
    assert isinstance(tokenizer, InputTokenizer)
    long_text = " ".join(["word"] * 300)
    with pytest.raises(ApiError) as too_long:
        tokenizer.texts(["ok", long_text], "input", truncate=False)
    assert too_long.value.param == "input[1]" and "at most 256 tokens" in too_long.value.message
    assert len(tokenizer.texts([long_text], "input", truncate=True)[0].ids) == 256
    with pytest.raises(ApiError) as empty:
        tokenizer.texts(["ok", ""], "input", truncate=False)
    assert empty.value.param == "input[1]"
    with pytest.raises(ApiError) as vocab:
        tokenizer.token_arrays([[101, 30522, 102]], "input", truncate=False, single=True)
    assert vocab.value.param == "input" and "30522" in vocab.value.message


def test_pipeline_auto_detects_an_embedding_folder(minilm_dir: Path, tmp_path: Path) -> None:
    from pipeserve.config import load_server_config
    from pipeserve.config.auto import resolve_auto
    from pipeserve.engine.embedding.spec import detect_kind
    from pipeserve.engine.weights.demo.build import ensure_demo_model
    from tests.server.serverproc import REPO

    assert detect_kind(minilm_dir) == "embedding"
    assert detect_kind(ensure_demo_model("qwen3")) is None
    config = tmp_path / "auto.yaml"
    config.write_text(
        f"pipelines_dir: {REPO / 'pipelines'}\n"
        f"models:\n  - {{name: m, source: {minilm_dir}, pipeline: auto}}\n"
        "endpoints:\n  - {route: /v1/embeddings, api: openai-embeddings}\n"
    )
    resolved = resolve_auto(load_server_config(config), {"m": minilm_dir})
    entry = resolved.config.models[0]
    assert (entry.kind, entry.pipeline) == ("embedding", "")
    assert resolved.pipeline_for(entry).name == "embedding"  # its kind's chain


def test_batches_group_by_length_from_the_oldest_input() -> None:
    from pipeserve.engine.embedding.batches import Pending, WaitingPool, lay_out
    from pipeserve.engine.embedding.jobs import Sequence
    from pipeserve.engine.embedding.mailbox import Mailbox

    lengths = [10, 40, 11, 9, 38, 10]
    job = EmbedJob("t", [Sequence(list(range(1, n + 1))) for n in lengths])
    pool = WaitingPool()
    pool.add(Pending(1, job, Mailbox()))
    first = pool.next_batch(budget=1000)
    assert [item.index for item in first] == [0, 2, 3, 5]  # the short ones, oldest first
    layout = lay_out(first)
    assert layout.ids.shape == (4, 11) and layout.mask.sum() == 10 + 11 + 9 + 10
    assert [item.index for item in pool.next_batch(budget=1000)] == [1, 4]
    assert pool.empty


def test_engine_gives_way_to_chat(minilm_dir: Path) -> None:
    """While a chat model decodes, batches shrink to Yielding.batch_tokens and a pause
    follows each (share 0.5: as long as the batch took)."""
    from pipeserve.engine.embedding.yielding import Yielding

    chat = [False]
    spec = build_spec(minilm_dir, EmbeddingOptions(), decoder=False, hidden_size=384)
    from pipeserve.engine.embedding.backbone import load_backbone

    engine = EmbeddingEngine(
        "y", lambda: load_backbone(minilm_dir, None, (None, None)), spec, EngineOptions(), 8192,
        yielding=Yielding(lambda: chat[0], share=0.5, batch_tokens=64),
    )  # fmt: skip
    tokenizer = InputTokenizer(minilm_dir, 256, 30522)
    try:
        texts = [f"sentence number {i}" for i in range(40)]  # 5 tokens each: 12 per batch
        for running, batches in ((False, 1), (True, 4)):
            chat[0] = running
            before = engine.stats()["batches_total"]
            result = engine.embed(EmbedJob("t", tokenizer.texts(texts, "input", False))).wait(60)
            assert result is not None and len(result.vectors) == 40
            assert engine.stats()["batches_total"] - before == batches
    finally:
        engine.close()
    assert Yielding(share=0.25).pause(0.1) == pytest.approx(0.3)
    assert Yielding(share=1.0).budget(8192, chat=True) == 8192
