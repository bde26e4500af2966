"""pipeserve against llama.cpp on real GGUF files from registry packages (real_ggufs.py):
the prompts' token ids, greedy continuations (32 tokens; near-ties as in
test_llamacpp.py), the first step's top-5 logits, and the tokenizer on a corpus with
code, whitespace runs, CJK, emoji, accents and the files' special tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.weights.real_ggufs import gemma3_270m, smollm2
from tests.engine.weights.test_llamacpp import CORPUS_COMMON, TOKENS, compare

pytestmark = [pytest.mark.llamacpp, pytest.mark.mlx]

GEMMA_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a"]
GEMMA_SPECIALS = ["<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
                  "<bos>the <eos>", "   leading spaces", "tabs\t\tand\nnewlines\n\n"]  # fmt: skip
SMOLLM_SPECIALS = ["<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|>x"]


def test_gemma3_270m_matches_llama_cpp(tmp_path: Path) -> None:
    from pipeserve.settings import pipeserve_home

    gguf = gemma3_270m(pipeserve_home())
    equal = compare(gguf, tmp_path, CORPUS_COMMON + GEMMA_SPECIALS, GEMMA_PROMPTS)
    print(f"gemma3-270m: steps equal to llama.cpp's {equal} of {TOKENS} each")
    assert sum(equal) >= 0.9 * len(GEMMA_PROMPTS) * TOKENS, equal


def test_smollm2_matches_llama_cpp(tmp_path: Path) -> None:
    from pipeserve.settings import pipeserve_home

    gguf = smollm2(pipeserve_home())
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time"]
    equal = compare(gguf, tmp_path, CORPUS_COMMON + SMOLLM_SPECIALS, prompts, exact=True)
    print(f"smollm2-135m: steps equal to llama.cpp's {equal} of {TOKENS} each")
    assert sum(equal) >= 0.9 * len(prompts) * TOKENS, equal
