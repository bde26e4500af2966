"""Offline demo models: build, load with mlx-lm, generate; tokenizers exact and offline."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx_lm
import pytest
import quicktok

from pipeserve.engine.weights.demo.build import (
    DEMO_FAMILIES,
    build_demo_models,
    demo_source,
    ensure_demo_model,
    ensure_tiktoken_base,
)
from pipeserve.engine.weights.demo.families import FAMILIES
from pipeserve.engine.weights.demo.vocab import derive_merges, read_ranks

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return [i**2 for i in range(100)]  # 1+2+3==6\n",
    "café résumé naïve — Zürich; 日本語のトークナイザー 中文 한국어; Ω≈ç√∫ Икс हिन्दी",
    "emoji \U0001f680\U0001f525\U0001f44d mixed   with\ttabs \r\n and CRLF\n\n\n",
    "don't can't I'll we've they're 'tis ALLCAPS 1234567890 3.14159 0xDEADBEEF",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
]
# quicktok encoding each family's vocab must match (specials encoded as text ranks aside)
QUICKTOK = {"qwen3": "qwen3", "gpt-oss": "o200k_harmony", "glm": "qwen3", "kimi": "cl100k_base"}
QUICKTOK.update({"llama3": "llama3", "mistral": "cl100k_base", "qwen3-coder": "qwen3"})
QUICKTOK.update({"deepseek": "qwen3", "phi4": "o200k_base", "granite": "cl100k_base"})
QUICKTOK.update({"gemma": "cl100k_base"})
HARMONY_TOKENS = (
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
    "<|constrain|>",
)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("family", DEMO_FAMILIES)
def test_tokenizer_matches_quicktok_and_round_trips(
    family: str, demo_tokenizer: Callable[[str], Any]
) -> None:
    hf = demo_tokenizer(family)._tokenizer
    encoding = quicktok.get_encoding(QUICKTOK[family])
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=False)
        assert ids == list(encoding.encode_ordinary(text)), text
        assert hf.decode(ids) == text


@pytest.mark.parametrize("family", DEMO_FAMILIES)
def test_special_tokens_are_single_ids(family: str, demo_tokenizer: Callable[[str], Any]) -> None:
    hf = demo_tokenizer(family)._tokenizer
    specials = FAMILIES[family].specials()
    for text, token_id in specials.items():
        assert hf.encode(text, add_special_tokens=False) == [token_id], text
        assert hf.decode([token_id]) == text
    mixed = f"a{FAMILIES[family].eos[0]}b"
    assert specials[FAMILIES[family].eos[0]] in hf.encode(mixed, add_special_tokens=False)


@pytest.mark.parametrize("family", DEMO_FAMILIES)
def test_eos_ids_come_from_config(
    family: str, demo_model_dir: Callable[[str], Path], demo_tokenizer: Callable[[str], Any]
) -> None:
    specials = FAMILIES[family].specials()
    expected = {specials[t] for t in FAMILIES[family].eos}
    config = json.loads((demo_model_dir(family) / "config.json").read_text())
    assert set(config["eos_token_id"]) == expected
    assert demo_tokenizer(family).eos_token_ids == expected
    assert demo_tokenizer(family)._tokenizer.eos_token == FAMILIES[family].eos[0]


def test_gpt_oss_harmony_ids_match_openai_harmony(
    demo_tokenizer: Callable[[str], Any], harmony_encoding: Any
) -> None:
    hf = demo_tokenizer("gpt-oss")._tokenizer
    for token in HARMONY_TOKENS:
        assert hf.encode(token, add_special_tokens=False) == harmony_encoding.encode(
            token, allowed_special="all"
        )
    text = "<|start|>assistant<|channel|>final<|message|>Héllo wörld 🚀<|return|>"
    assert hf.encode(text, add_special_tokens=False) == harmony_encoding.encode(
        text, allowed_special="all"
    )


def test_tiktoken_file_is_the_real_o200k_base(pipeserve_home: Path) -> None:
    folder = ensure_tiktoken_base(pipeserve_home, set_env=False)
    digest = sha256(folder / "o200k_base.tiktoken")
    assert digest.startswith("446a9538") and digest.endswith("a2d")


@pytest.mark.mlx
@pytest.mark.parametrize("family", DEMO_FAMILIES)
def test_demo_model_loads_and_generates_deterministically(
    family: str, demo_model: Callable[[str], Any]
) -> None:
    model, tokenizer = demo_model(family)
    prompt = tokenizer._tokenizer.encode("Hello there, how are you?", add_special_tokens=False)
    first = mlx_lm.generate(model, tokenizer, prompt, max_tokens=8)
    second = mlx_lm.generate(model, tokenizer, prompt, max_tokens=8)
    assert first and first == second
    assert (
        len(set(tokenizer._tokenizer.encode(first, add_special_tokens=False))) > 1
    )  # not one token repeated


@pytest.mark.parametrize("family", DEMO_FAMILIES)
def test_chat_template_renders(family: str, demo_tokenizer: Callable[[str], Any]) -> None:
    hf = demo_tokenizer(family)._tokenizer
    prompt = hf.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert "hi" in prompt


def test_build_is_deterministic(tmp_path: Path, demo_model_dir: Callable[[str], Path]) -> None:
    shared = demo_model_dir("kimi")
    fresh = ensure_demo_model("kimi", tmp_path)
    assert fresh != shared
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert sha256(fresh / name) == sha256(shared / name), name


def _build_in_process(home: str) -> str:
    return str(ensure_demo_model("kimi", Path(home)))


def test_concurrent_builders_agree(tmp_path: Path, demo_model_dir: Callable[[str], Path]) -> None:
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        paths = pool.map(_build_in_process, [str(tmp_path)] * 2)
    assert paths[0] == paths[1]
    built = Path(paths[0])
    assert sha256(built / "model.safetensors") == sha256(
        demo_model_dir("kimi") / "model.safetensors"
    )
    assert [p.name for p in (tmp_path / "demo").iterdir()] == [built.name]  # no temp leftovers


def test_ensure_is_a_no_op_when_built(
    demo_model_dir: Callable[[str], Path], pipeserve_home: Path
) -> None:
    path = demo_model_dir("qwen3")
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert build_demo_models(pipeserve_home, ["qwen3"]) == [path]
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_demo_source() -> None:
    assert demo_source("demo:qwen3") == "qwen3"
    assert demo_source("demo:gpt-oss") == "gpt-oss"
    assert demo_source("mlx-community/Qwen3-0.6B-4bit") is None
    assert demo_source("/models/qwen") is None
    with pytest.raises(ValueError, match="demo:qwen3"):
        demo_source("demo:llama")


def test_unknown_family_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown demo family"):
        ensure_demo_model("llama", tmp_path)


def test_derived_merges_rebuild_every_token() -> None:
    tokens = read_ranks("cl100k")
    merges = derive_merges(tokens)
    assert [tokens[a] + tokens[b] for a, b in merges] == [t for t in tokens if len(t) > 1]


def test_older_builds_are_removed(tmp_path: Path) -> None:
    from pipeserve.engine.weights.demo.build import DEMO_VERSION, demo_model_dir

    stale = tmp_path / "demo" / "kimi-v0"
    stale.mkdir(parents=True)
    other = tmp_path / "demo" / "kimi-vault"  # not a version folder: kept
    other.mkdir()
    path = ensure_demo_model("kimi", tmp_path)
    assert path == demo_model_dir("kimi", tmp_path) and path.name == f"kimi-v{DEMO_VERSION}"
    assert not stale.exists() and other.exists()
