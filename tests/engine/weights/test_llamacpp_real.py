"""pipeserve against llama.cpp on real GGUF files from registry packages (real_ggufs.py):
the prompts' token ids, greedy continuations (32 tokens; near-ties as in
test_llamacpp.py), the first step's top-5 logits, and the tokenizer on a corpus with
code, whitespace runs, CJK, emoji, accents and the files' special tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.weights.llamacpp import llama_python, run_llama
from tests.engine.weights.real_ggufs import gemma3_270m, smollm2
from tests.engine.weights.test_llamacpp import CORPUS_COMMON, TOKENS, compare

pytestmark = [pytest.mark.llamacpp, pytest.mark.mlx]

GEMMA_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a"]
GEMMA_SPECIALS = ["<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
                  "<bos>the <eos>", "   leading spaces", "tabs\t\tand\nnewlines\n\n"]  # fmt: skip
SMOLLM_SPECIALS = ["<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|>x"]


def test_gemma3_270m_matches_llama_cpp(tmp_path: Path) -> None:
    from pipeserve.settings import pipeserve_home

    llama_python()  # skips before the 250 MB download where llama.cpp is not built
    gguf = gemma3_270m(pipeserve_home())
    equal = compare(gguf, tmp_path, CORPUS_COMMON + GEMMA_SPECIALS, GEMMA_PROMPTS)
    print(f"gemma3-270m: steps equal to llama.cpp's {equal} of {TOKENS} each")
    assert sum(equal) >= 0.9 * len(GEMMA_PROMPTS) * TOKENS, equal


def test_smollm2_matches_llama_cpp(tmp_path: Path) -> None:
    from pipeserve.settings import pipeserve_home

    llama_python()
    gguf = smollm2(pipeserve_home())
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time"]
    equal = compare(gguf, tmp_path, CORPUS_COMMON + SMOLLM_SPECIALS, prompts, exact=True)
    print(f"smollm2-135m: steps equal to llama.cpp's {equal} of {TOKENS} each")
    assert sum(equal) >= 0.9 * len(prompts) * TOKENS, equal


def test_gemma3_270m_served_over_http(tmp_path: Path) -> None:
    """The server answers /v1/completions with llama.cpp's greedy text (10 tokens, before
    any divergence), chat answers 400 (no template in the file), and the same file with
    `chat_template: gemma` answers chat."""
    import openai

    from pipeserve.settings import pipeserve_home
    from tests.server.serverproc import running_server

    llama_python()  # with the llama.cpp job only: a 250 MB download
    gguf = gemma3_270m(pipeserve_home())
    prompt = "The capital of France is"
    reference = run_llama(gguf, [prompt], 10, [], tmp_path)["prompts"][0]["greedy"]
    config = tmp_path / "gemma.yaml"
    config.write_text(
        "models:\n"
        f"  - {{name: gemma, source: {gguf}, pipeline: auto}}\n"
        f"  - {{name: gemma-chat, source: {gguf}, pipeline: chatml, chat_template: gemma}}\n"
        "endpoints:\n  - {route: /v1/completions, api: openai-completions}\n"
        "  - {route: /v1/chat/completions, api: openai-chat}\n"
    )
    with running_server(config, {"PIPESERVE_HOME": str(pipeserve_home())}) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        reply = client.completions.create(model="gemma", prompt=prompt, max_tokens=10,
                                          temperature=0)  # fmt: skip
        from pipeserve.engine.weights.gguf import ensure_converted
        from pipeserve.engine.weights.loader import load_tokenizer

        tokenizer = load_tokenizer(ensure_converted(gguf, pipeserve_home()))
        assert reply.choices[0].text == tokenizer.decode(reference)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(
                model="gemma", messages=[{"role": "user", "content": "hi"}]
            )
        chat = client.chat.completions.create(
            model="gemma-chat", messages=[{"role": "user", "content": "Say hi"}], max_tokens=8
        )
        assert chat.choices[0].message.content
