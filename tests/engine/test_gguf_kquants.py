"""K-quant GGUFs and sentencepiece-style (`llama`) vocabularies, on tiny generated files:
re-quantized weights stay within one step of MLX's grid of gguf-py's own dequantization, greedy generation through pipeserve's engine equals a numpy model on
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
from pipeserve.engine.gguf import ensure_converted
from pipeserve.engine.gguf.architectures import ARCHITECTURES
from pipeserve.engine.gguf.convert import mlx_name
from pipeserve.engine.gguf.requantize import GROUP_SIZE, REQUANT_BITS
from pipeserve.engine.loader import load_tokenizer
from pipeserve.engine.runtime import build_runtime
from tests.engine.gguf_fixtures import K_QUANT, write_tiny_gguf
from tests.engine.gguf_reference import NumpyLlama, transformers_tokenizer
from tests.engine.helpers import collect, job
from tests.engine.test_smollm2_reference import varied_strings

pytestmark = pytest.mark.mlx

# Every re-quantized type, each on some tensor (blk.1 holds the legacy ones).
EVERY_TYPE = {"token_embd": T.Q4_K, "attn_q": T.Q4_K, "attn_k": T.Q5_K, "attn_v": T.Q6_K,
              "attn_output": T.Q3_K, "ffn_gate": T.Q2_K, "ffn_up": T.Q4_K, "ffn_down": T.Q6_K,
              "output": T.Q6_K}  # fmt: skip
LEGACY = {"blk.1.ffn_up.weight": T.Q5_0, "blk.1.ffn_down.weight": T.Q8_0}
# llama.cpp's Q4_K_M mix: Q6_K for attn_v, ffn_down and the output matrix, Q4_K elsewhere.
Q4_K_M = {"attn_v": T.Q6_K, "ffn_down": T.Q6_K, "output": T.Q6_K}


def every_type(name: str) -> T:
    return LEGACY.get(name) or EVERY_TYPE[name.removesuffix(".weight").rsplit(".", 1)[-1]]


def q4_k_m(name: str) -> T:
    return Q4_K_M.get(name.removesuffix(".weight").rsplit(".", 1)[-1], T.Q4_K)


def _k_model(tmp_path: Path, types: object) -> tuple[Path, Path]:
    gguf = write_tiny_gguf(tmp_path / "k.gguf", "llama", types, tied=False, vocab="spm",
                           dims=K_QUANT)  # fmt: skip
    return gguf, ensure_converted(gguf, tmp_path / "home")


def test_requantized_weights_are_within_a_step_of_the_gguf_values(tmp_path: Path) -> None:
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
        assert bits == REQUANT_BITS[kind], tensor.name
        w, scales, biases = (weights[f"{name}.{part}"] for part in ("weight", "scales", "biases"))
        ours = np.array(mx.dequantize(w, scales, biases, group_size=GROUP_SIZE, bits=bits))
        error = np.abs(ours - reference.reshape(ours.shape)).reshape(*scales.shape, GROUP_SIZE)
        # One step of each group's grid (MLX keeps the group's larger edge exact, so its
        # rounding reaches up to a step, not half), plus float16 rounding of scale and bias.
        step, bias = (np.abs(np.array(a.astype(mx.float32)))[..., None] for a in (scales, biases))
        bound = step + 2**-10 * (bias + step * (2**bits - 1))
        assert (error <= bound).all(), (tensor.name, float((error - bound).max()))
    assert seen == {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q8_0"}


GREEDY_TOKENS = 12


def test_q4_k_m_greedy_generation_matches_the_dequantized_model(tmp_path: Path) -> None:
    gguf, _folder = _k_model(tmp_path, q4_k_m)
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
