"""The shipped default model, SmolLM2-135M-Instruct (Q4_1 GGUF), checked against
independent implementations on the same file:

- its converted tokenizer gives transformers' GGUF tokenizer's ids on a few hundred
  varied strings (code, digits, unicode, whitespace runs, special tokens);
- pipeserve's engine (the CPU layout: dequantized float32) generates, for a handful of
  prompts, 20 greedy tokens that a float32 numpy forward pass on gguf-py's
  dequantized weights also picks, with logits that agree closely.
"""

from __future__ import annotations

import itertools
import random
import re
from pathlib import Path

import numpy as np
import pytest

from pipeserve.config.models import EngineOptions, ModelEntry
from pipeserve.engine.runtime import build_runtime
from pipeserve.engine.weights.loader import load_tokenizer
from tests.engine.helpers import collect, job
from tests.engine.weights.gguf_reference import NumpyLlama, transformers_tokenizer

pytestmark = pytest.mark.mlx

FRAGMENTS = [
    "Hello, world!",
    "The capital of France is Paris.",
    "def add(a, b):\n    return a + b\n",
    "for (int i = 0; i < 10; ++i) { sum += i; }",
    "3.14159",
    "1234567890",
    "2024-11-30",
    "  leading spaces",
    "trailing spaces   ",
    "tabs\t\tand\nnewlines\n\n",
    "\r\n",
    "x" * 40,
    "héllo wörld",
    "naïve café",
    "日本語のテキスト",
    "Привет, мир",
    "مرحبا",
    "emoji 🙂🚀👍🏽",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_start|>user\nhi<|im_end|>",
    "it's don't we'll they're I'M",
    "ALL CAPS SHOUT",
    "snake_case_name",
    "camelCaseName",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    '<div class="x">&amp;</div>',
    "SELECT * FROM t WHERE id = 42;",
    "$ pip install -e '.[test]'",
    "    ",
    "\u00a0nbsp",
    "a1b2c3",
    "1,000,000.00",
    "e^{i\\pi} + 1 = 0",
    "---",
    "...",
    "?!",
    "«quotes»",
    "",
]


def varied_strings(count: int = 300) -> list[str]:
    """The fragments alone, then seeded random joins of two to four of them."""
    rng = random.Random(11)
    out = list(FRAGMENTS)
    joiners = ["", " ", "\n", "  ", "\t"]
    while len(out) < count:
        parts = rng.sample(FRAGMENTS, rng.randint(2, 4))
        out.append("".join(itertools.chain.from_iterable((p, rng.choice(joiners)) for p in parts)))
    return out


def _mismatches(ours: object, theirs: object, strings: list[str]) -> list[str]:
    return [
        s
        for s in strings
        if ours.encode(s, add_special_tokens=False)  # type: ignore[attr-defined]
        != theirs.encode(s, add_special_tokens=False).ids  # type: ignore[attr-defined]
    ]


def test_tokenizer_matches_transformers_gguf_tokenizer(smollm2: tuple[Path, Path]) -> None:
    gguf, folder = smollm2
    ours = load_tokenizer(folder)
    strings = varied_strings()
    assert len(strings) >= 300
    assert _mismatches(ours, transformers_tokenizer(gguf), strings) == []
    for s in strings:
        assert ours.decode(ours.encode(s, add_special_tokens=False)) == s
    # Without llama.cpp's digit split, transformers differs only where whitespace runs
    # into a digit ("  3": llama.cpp and SmolLM2's tokenizer.json give "ĠĠ" "3").
    plain = _mismatches(ours, transformers_tokenizer(gguf, llama_cpp_splits=False), strings)
    assert plain and all(re.search(r"\s\d", s) for s in plain)


PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers.",
]
GREEDY_TOKENS = 20


def test_greedy_tokens_match_numpy_reference(smollm2: tuple[Path, Path]) -> None:
    gguf, _folder = smollm2
    entry = ModelEntry(name="smollm2", source=str(gguf), pipeline="chatml",
                       options=EngineOptions(dtype="auto"))  # fmt: skip
    runtime = build_runtime(entry)
    try:
        tokenizer = runtime.tokenizer
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True
            )
            for p in PROMPTS
        ]
        # No stop ids: 20 tokens each, past an early end of turn too.
        streams = [runtime.engine.submit(job(p, GREEDY_TOKENS)) for p in prompts]
        generated = [collect(s).ids for s in streams]
    finally:
        runtime.engine.close()
    reference = NumpyLlama(gguf)
    for prompt, ids in zip(prompts, generated, strict=True):
        assert len(ids) == GREEDY_TOKENS
        agree, logits = reference.greedy_agrees(list(prompt), ids)
        assert agree == GREEDY_TOKENS, (tokenizer.decode(ids), agree)
        # Logits at the picked positions: numpy's float32 vs MLX's float32 (OpenBLAS).
        assert np.all(np.isfinite(logits))
    assert "Paris" in tokenizer.decode(generated[0])


# Absolute, on logits up to ~40. The kernels round each activation to an int16 on the
# scale of its run of 8 (2^-15 of the run's largest magnitude; exact integer products,
# the same numbers at every batch size): measured up to 4.3e-3 (~1.3e-4 of the largest
# logit; bfloat16 activations would be ~1e-1). Greedy tokens are checked exactly above.
LOGIT_TOLERANCE = 1e-2


def test_cpu_kernel_logits_match_the_float32_layout(smollm2: tuple[Path, Path]) -> None:
    """The CPU kernels (blocks as stored) against the dequantized float32 layout: every
    reference prompt's logits, prefill and 8 greedy steps, within LOGIT_TOLERANCE."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from pipeserve.engine import cpu_kernels
    from pipeserve.engine.cpu_kernels.layers import KernelLinear
    from pipeserve.engine.weights.loader import load_model

    if cpu_kernels.kernels() is None:
        pytest.skip("the CPU kernels are unavailable or switched off here")
    _gguf, folder = smollm2
    fast, dense = load_model(folder, "auto", True), load_model(folder, "float32", True)
    assert any(isinstance(m, KernelLinear) for _, m in fast.named_modules())
    tokenizer = load_tokenizer(folder)
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True)  # fmt: skip
        caches = make_prompt_cache(fast), make_prompt_cache(dense)
        tokens = mx.array([ids])
        for _ in range(9):
            ours, theirs = (m(tokens, cache=c)[:, -1] for m, c in zip((fast, dense), caches))
            assert mx.abs(ours - theirs).max().item() <= LOGIT_TOLERANCE, prompt
            tokens = mx.argmax(theirs, axis=-1, keepdims=True)


# A prompt long enough (~250 tokens) that its prefill multiplies more than 64 rows at once:
# on an AVX512-VNNI build the int8 prompt GEMM (cpu_kernels/prefill_gemm.cpp) takes it.
LONG_PROMPT = (
    "Here are my notes from the week. "
    + " ".join(
        f"On day {d} I walked {d * 3 % 7 + 2} miles and read {d % 4 + 1} chapters."
        for d in range(1, 15)
    )
    + " Summarize the notes in one sentence."
)


def test_long_prompt_greedy_tokens_match_numpy_reference(smollm2: tuple[Path, Path]) -> None:
    """Prefill through the prompt GEMM (x rounded to int16 per run of 32, the default): the
    20 greedy tokens are still the float32 numpy reference's own choices. (The batched
    prefill of test_greedy_tokens_match_numpy_reference, 74-148 rows, takes it too.)"""
    from pipeserve.engine.cpu_kernels import apply_prefill_mode, kernels

    ext = kernels()
    if ext is None or not ext.prefill_gemm_built():
        pytest.skip("the prompt GEMM needs the CPU kernels on an AVX512-VNNI CPU")
    gguf, _folder = smollm2
    entry = ModelEntry(name="smollm2", source=str(gguf), pipeline="chatml",
                       options=EngineOptions(dtype="auto"))  # fmt: skip
    ext.set_prefill_gemm(True)
    ext.set_prefill_int8(False)
    runtime = build_runtime(entry)
    try:
        prompt = runtime.tokenizer.apply_chat_template(
            [{"role": "user", "content": LONG_PROMPT}], add_generation_prompt=True
        )
        ids = collect(runtime.engine.submit(job(prompt, GREEDY_TOKENS))).ids
    finally:
        runtime.engine.close()
        apply_prefill_mode(ext)
    assert len(prompt) > 200
    agree, logits = NumpyLlama(gguf).greedy_agrees(list(prompt), ids)
    assert agree == GREEDY_TOKENS, (runtime.tokenizer.decode(ids), agree)
