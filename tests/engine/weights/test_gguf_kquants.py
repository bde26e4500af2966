"""K-quant GGUFs and sentencepiece-style (`llama`) vocabularies, on tiny generated files:
converted weights equal gguf-py's own dequantization up to float16 scales (repacked
types) or within one step of MLX's grid (re-quantized types), greedy generation through pipeserve's engine equals a numpy model on
the dequantized weights, and the tokenizer gives transformers' GGUF tokenizer's ids."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, dequantize

from pipeserve.config.models import EngineOptions, ModelEntry
from pipeserve.engine.runtime import build_runtime
from pipeserve.engine.weights.gguf import ensure_converted
from pipeserve.engine.weights.gguf.architectures import ARCHITECTURES
from pipeserve.engine.weights.gguf.convert import mlx_name
from pipeserve.engine.weights.gguf.tensors import GROUP_SIZE, REQUANT_BITS, q6_k_symmetric
from pipeserve.engine.weights.loader import load_model, load_tokenizer
from tests.engine.helpers import collect, job
from tests.engine.weights.gguf_fixtures import K_QUANT, write_tiny_gguf
from tests.engine.weights.gguf_reference import NumpyLlama, transformers_tokenizer
from tests.engine.weights.test_smollm2_reference import varied_strings

pytestmark = pytest.mark.mlx

# Every re-quantized type, each on some tensor (blk.1 holds the legacy ones).
EVERY_TYPE = {"token_embd": T.Q4_K, "attn_q": T.Q4_K, "attn_k": T.Q5_K, "attn_v": T.Q6_K,
              "attn_output": T.Q3_K, "ffn_gate": T.Q2_K, "ffn_up": T.Q4_K, "ffn_down": T.Q6_K,
              "output": T.Q6_K}  # fmt: skip
LEGACY = {"blk.1.ffn_up.weight": T.Q5_0, "blk.1.ffn_down.weight": T.Q8_0}
# MLX bits: repacked exactly at the stored width, or re-quantized two bits wider.
WIDTHS = {"Q4_K": 4, "Q5_K": 5, "Q5_0": 5, "Q8_0": 8, "Q2_K": 4, "Q3_K": 5, "Q6_K": 8}
# llama.cpp's Q4_K_M mix: Q6_K for attn_v, ffn_down and the output matrix, Q4_K elsewhere.
Q4_K_M = {"attn_v": T.Q6_K, "ffn_down": T.Q6_K, "output": T.Q6_K}
# Only types repacked exactly (Q4_K elsewhere).
REPACKED = {"attn_v": T.Q5_K, "ffn_down": T.Q5_K, "ffn_up": T.Q5_0, "output": T.Q8_0}


def every_type(name: str) -> T:
    return LEGACY.get(name) or EVERY_TYPE[name.removesuffix(".weight").rsplit(".", 1)[-1]]


def q4_k_m(name: str) -> T:
    return Q4_K_M.get(name.removesuffix(".weight").rsplit(".", 1)[-1], T.Q4_K)


def repacked(name: str) -> T:
    return REPACKED.get(name.removesuffix(".weight").rsplit(".", 1)[-1], T.Q4_K)


def _k_model(tmp_path: Path, types: object) -> tuple[Path, Path]:
    gguf = write_tiny_gguf(tmp_path / "k.gguf", "llama", types, tied=False, vocab="spm",
                           dims=K_QUANT)  # fmt: skip
    return gguf, ensure_converted(gguf, tmp_path / "home")


def test_converted_weights_match_the_gguf_values(tmp_path: Path) -> None:
    import mlx.core as mx

    gguf, folder = _k_model(tmp_path, every_type)
    quantization = json.loads((folder / "config.json").read_text())["quantization"]
    weights = mx.load(str(folder / "model.safetensors"))
    seen = set()
    for tensor in GGUFReader(str(gguf)).tensors:
        kind = tensor.tensor_type.name
        reference = dequantize(tensor.data, tensor.tensor_type)
        name = mlx_name(tensor.name, ARCHITECTURES["llama"])
        if kind == "F32":
            assert np.array_equal(np.array(weights[f"{name}.weight"]).ravel(), reference.ravel())
            continue
        seen.add(kind)
        bits = quantization.get(name, quantization)["bits"]
        assert bits == WIDTHS[kind], tensor.name
        w = weights[f"{name}.weight"]
        scales, biases = (weights[f"{name}.{p}"].astype(mx.float32) for p in ("scales", "biases"))
        ours = np.array(mx.dequantize(w, scales, biases, group_size=GROUP_SIZE, bits=bits))
        error = np.abs(ours - reference.reshape(ours.shape)).reshape(*scales.shape, GROUP_SIZE)
        step, bias = (np.abs(np.array(a))[..., None] for a in (scales, biases))
        # The float16 rounding of scale and bias; re-quantized types also one step of
        # their group's grid (MLX keeps the larger edge exact, so not just half a step).
        bound = 2**-11 * (bias + step * (2**bits - 1)) + 1e-7
        if kind in REQUANT_BITS:
            bound = bound + step
        assert (error <= bound).all(), (tensor.name, float((error - bound).max()))
    assert seen == set(WIDTHS)


def random_q6_k_blocks(count: int, seed: int) -> np.ndarray:
    """Valid Q6_K blocks: random 6-bit codes, signed 8-bit scales, small positive d."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (count, 210), dtype=np.uint8)
    blocks[:, 192:208] = rng.integers(-127, 128, (count, 16)).astype(np.int8).view(np.uint8)
    d = rng.uniform(1e-4, 1e-3, count).astype(np.float16)
    blocks[:, 208:210] = d.view(np.uint8).reshape(count, 2)
    return blocks


def test_q6_k_is_requantized_to_symmetric_8_bits() -> None:
    """Per 32 weights the step is a quarter of the larger sub-block's |d x sc|: that
    sub-block's weights exact but for the step's float16 rounding, the other's within half a
    step (one where the integer clips at 127), the bias -128 x the step, and a smaller
    error than MLX's own 8-bit re-quantization (which also keeps a bias per group)."""
    import mlx.core as mx

    blocks = random_q6_k_blocks(64, 5)
    q, step, bias = q6_k_symmetric(blocks)
    values = dequantize(blocks, T.Q6_K).reshape(-1, 32)
    assert np.array_equal(step.astype(np.float16).astype(np.float32), step)
    assert np.array_equal(bias, -128 * step) and (step < 0).any()  # the larger's sign
    error = np.abs((q.astype(np.float32) - 128) * step[:, None] - values)
    sub = np.abs(blocks[:, 192:208].view(np.int8).astype(np.float32)).reshape(-1, 2)
    larger = np.repeat(np.where(sub[:, :1] >= sub[:, 1:], [[1, 0]], [[0, 1]]), 16, axis=1) == 1
    assert (error[larger] <= 2**-11 * np.abs(values[larger]) + 1e-9).all()
    size = np.abs(step)[:, None].repeat(32, axis=1)
    clipped = q == 255  # (or a 127 that was not clipped)
    assert (error[~clipped] <= size[~clipped] * 0.5 + 1e-9).all()
    assert (error <= size * (1 + 128 * 2**-11) + 1e-9).all()  # 128 clipped to 127
    w, scales, biases = mx.quantize(mx.array(values.reshape(-1, 256)), group_size=32, bits=8)
    scales, biases = (a.astype(mx.float16).astype(mx.float32) for a in (scales, biases))
    as_mlx = mx.dequantize(w, scales, biases, group_size=32, bits=8)
    mlx_error = np.abs(np.array(as_mlx).reshape(-1, 32) - values)
    assert np.sqrt((error**2).mean()) < np.sqrt((mlx_error**2).mean())


GREEDY_TOKENS = 12


def test_repacked_k_quants_give_the_dequantized_models_logits(tmp_path: Path) -> None:
    import mlx.core as mx
    import mlx_lm

    gguf, folder = _k_model(tmp_path, repacked)
    tokens = [1, 300, 320, 261, 314, 315, 262, 330, 340]
    reference = NumpyLlama(gguf).forward(tokens)  # float32 on gguf-py's dequantization
    quantized, _ = mlx_lm.load(str(folder))  # mlx-lm's own loader, as converted
    for model in (quantized, load_model(folder, "float32")):  # and pipeserve's CPU layout
        logits = np.array(model(mx.array([tokens]))[0].astype(mx.float32))
        # Only the float16 rounding of the K sub-block scales (measured: 4.5e-4).
        assert np.abs(logits - reference).max() < 2e-3 * np.abs(reference).max()
        assert (logits.argmax(-1) == reference.argmax(-1)).all()


def test_large_conversions_are_written_in_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlx.core as mx
    import mlx_lm

    from pipeserve.engine.weights.gguf import shards

    gguf, whole = _k_model(tmp_path, repacked)
    monkeypatch.setattr(shards, "SHARD_BYTES", 200_000)  # this model's weights: ~1.3 MB
    sharded = ensure_converted(gguf, tmp_path / "sharded")
    files = sorted(p.name for p in sharded.glob("model*.safetensors"))
    assert len(files) > 3 and files[-1] == f"model-{len(files):05d}-of-{len(files):05d}.safetensors"
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(mx.load(str(whole / "model.safetensors")))
    tokens = mx.array([[1, 300, 320, 261, 314]])
    logits = [np.array(mlx_lm.load(str(folder))[0](tokens)) for folder in (whole, sharded)]
    assert np.array_equal(*logits)


def test_q4_k_m_greedy_generation_matches_the_dequantized_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIPESERVE_HOME", str(tmp_path / "home"))  # converted here, fresh
    gguf = write_tiny_gguf(tmp_path / "k.gguf", "llama", q4_k_m, tied=False, vocab="spm",
                           dims=K_QUANT)  # fmt: skip
    entry = ModelEntry(name="k", source=str(gguf), pipeline="qwen3",
                       options=EngineOptions(dtype="auto"))  # fmt: skip
    runtime = build_runtime(entry)
    try:
        tokenizer = runtime.tokenizer
        prompts = [tokenizer.encode(text) for text in ("the theater", "hello world 12")]
        generated = [collect(runtime.engine.submit(job(p, GREEDY_TOKENS))).ids for p in prompts]
    finally:
        runtime.engine.close()
    reference = NumpyLlama(gguf)  # float32, on gguf-py's dequantization of the K blocks
    for prompt, ids in zip(prompts, generated, strict=True):
        assert prompt[0] == 1  # a sentencepiece vocabulary adds BOS unless the file says not
        assert len(ids) == GREEDY_TOKENS
        agree, _logits = reference.greedy_agrees(list(prompt), ids)
        assert agree == GREEDY_TOKENS, (ids, agree)


SPECIALS = ("[INST]", "[/INST]", "<s>", "</s>", "<unk>")


def test_sentencepiece_tokenizer_matches_transformers(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "spm.gguf", vocab="spm")
    ours = load_tokenizer(ensure_converted(gguf, tmp_path / "home"))
    strings = varied_strings() + ["[INST] hi [/INST]", "x[INST]y</s>", "<unk>é", " lead"]
    theirs = transformers_tokenizer(gguf)
    for text in strings:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False).ids, text
        if not any(s in text for s in SPECIALS):
            assert ours.decode(ids) == text
    # transformers' own prefix rule differs only on text starting with whitespace or
    # following a special token (llama.cpp: a "▁" before each piece of text).
    plain = transformers_tokenizer(gguf, llama_cpp_splits=False)
    differ = [
        s
        for s in strings
        if ours.encode(s, add_special_tokens=False) != plain.encode(s, add_special_tokens=False).ids
    ]
    assert differ and all(re.match(r"\s", s) or any(t in s for t in SPECIALS) for s in differ)
    assert ours.encode("hi")[0] == 1 and ours.convert_ids_to_tokens(ours.encode("hi")) == [
        "<s>", "▁", "h", "i"
    ]  # fmt: skip
