"""`pipeline: auto` for the tool-call families of issue 36, from a model folder and from
a GGUF file (its metadata; nothing converted), with `validate --explain` saying why;
the families detected before keep their pipelines."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipeserve.cli import main
from pipeserve.config import load_server_config
from pipeserve.config.auto import resolve_auto
from pipeserve.config.detect import detect_pipeline, read_evidence
from tests.config.shipped import REPO
from tests.config.test_detect import fake_model, shipped, write_config  # noqa: F401

NEW_FAMILIES = ["llama3", "mistral", "qwen3-coder", "deepseek", "phi4", "granite", "gemma"]

LLAMA31 = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]  # fmt: skip
DEEPSEEK = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
            "<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"]  # fmt: skip
MISTRAL = ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[ARGS]"]
CODER_TEMPLATE = "<|im_start|>...<tool_call>\n<function=example>\n<parameter=x>\n"
PHI4 = ["<|user|>", "<|assistant|>", "<|end|>", "<|system|>", "<|tool_call|>", "<|/tool_call|>"]
GRANITE = ["<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"]
GEMMA = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_each_demo_model_detects_as_its_family(
    family: str, demo_model_dir: Callable[[str], Path], shipped: dict[str, Any]
) -> None:
    detection = detect_pipeline(read_evidence(demo_model_dir(family)), shipped)
    assert (detection.pipeline, detection.fallback) == (family, False), detection.describe()


# What real models' folders say (config.json model_type, special tokens, template).
REAL = [
    ("llama-3.1-8b", "llama", LLAMA31, "", "llama3"),
    ("llama-3.2-3b-template-only", "llama", [], "<|start_header_id|>x<|end_header_id|><|eot_id|>", "llama3"),
    ("r1-distill-llama", "llama", DEEPSEEK[:6] + LLAMA31[2:5], "", "deepseek"),
    ("r1-distill-qwen", "qwen2", DEEPSEEK[:6] + ["<tool_call>", "</tool_call>"], "", "deepseek"),
    ("deepseek-v3", "deepseek_v3", DEEPSEEK, "", "deepseek"),
    ("kimi-k2-config", "kimi_k2", [], "", "kimi"),
    ("mistral-small-3.1", "mistral3", MISTRAL, "", "mistral"),
    ("magistral", "mistral", MISTRAL + ["[THINK]", "[/THINK]"], "", "mistral"),
    ("mistral-with-chatml-template", "mistral", [], "{{ '<|im_start|>' + m.role }}", "chatml"),
    ("qwen3-coder-30b", "qwen3_moe", ["<|im_start|>", "<|im_end|>", "<tool_call>"], CODER_TEMPLATE,
     "qwen3-coder"),
    ("qwen3-30b", "qwen3_moe", ["<|im_start|>", "<|im_end|>", "<think>"], "<|im_start|><tool_call>", "qwen3"),
    ("phi-4-mini", "phi3", PHI4, "", "phi4"),
    ("granite-3.3", "granite", GRANITE, "", "granite"),
    ("granite-4-hybrid", "granitemoehybrid", GRANITE, "", "granite"),
    ("gemma-3", "gemma3", GEMMA, "", "gemma"),
    ("gemma-2", "gemma2", GEMMA, "", "gemma"),
    ("glm-4.6", "glm4_moe", ["<think>", "</think>", "<tool_call>"], "", "glm"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("model_type", "tokens", "template", "expected"),
    [r[1:] for r in REAL],
    ids=[r[0] for r in REAL],
)
def test_real_model_folders_pick_their_family(
    tmp_path: Path,
    shipped: dict[str, Any],
    model_type: str,
    tokens: list[str],
    template: str,
    expected: str,
) -> None:
    folder = fake_model(tmp_path / "m", model_type, tokens, template)
    detection = detect_pipeline(read_evidence(folder), shipped)
    assert (detection.pipeline, detection.fallback) == (expected, False), detection.describe()


def fake_gguf(path: Path, arch: str, specials: list[str], template: str = "") -> Path:
    """A GGUF file with only the metadata detection reads (no tensors)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    tokens = [*specials, "a", "b", "ab"]
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", [3] * len(specials) + [1, 1, 1])
    if template:
        writer.add_string("tokenizer.chat_template", template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# What real GGUF files say: general.architecture, control tokens, the chat template.
GGUFS = [
    ("llama-3.1", "llama", LLAMA31, "", "llama3"),
    ("mistral-nemo", "llama", MISTRAL, "", "mistral"),
    ("qwen3-coder", "qwen3moe", ["<|im_start|>", "<|im_end|>", "<tool_call>"], CODER_TEMPLATE,
     "qwen3-coder"),
    ("qwen3", "qwen3moe", ["<|im_start|>", "<|im_end|>"], "", "qwen3"),
    ("deepseek-v3", "deepseek2", DEEPSEEK, "", "deepseek"),
    ("r1-distill-qwen", "qwen2", DEEPSEEK[:6], "", "deepseek"),
    ("phi-4-mini", "phi3", PHI4, "", "phi4"),
    ("granite", "granite", GRANITE, "", "granite"),
    ("gemma-3", "gemma3", GEMMA, "", "gemma"),
    ("glm-4.6", "glm4moe", [], "", "glm"),
    ("gpt-oss", "gpt-oss", [], "", "gpt-oss"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("arch", "tokens", "template", "expected"), [g[1:] for g in GGUFS], ids=[g[0] for g in GGUFS]
)
def test_gguf_files_pick_their_family_from_metadata(
    tmp_path: Path,
    shipped: dict[str, Any],
    arch: str,
    tokens: list[str],
    template: str,
    expected: str,
) -> None:
    path = fake_gguf(tmp_path / "m.gguf", arch, tokens, template)
    detection = detect_pipeline(read_evidence(path), shipped)
    assert (detection.pipeline, detection.fallback) == (expected, False), detection.describe()


def test_a_gguf_auto_entry_resolves_and_explains(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], demo_model_dir: Callable[[str], Path]
) -> None:
    from tests.engine.weights.gguf_fixtures import write_tiny_gguf

    demo_model_dir("deepseek")
    gguf = write_tiny_gguf(tmp_path / "llama31.gguf", specials=tuple(LLAMA31))
    config = write_config(tmp_path, [("g", str(gguf), "auto"), ("d", "demo:deepseek", "auto")])
    resolved = resolve_auto(
        load_server_config(config), {"g": gguf, "d": demo_model_dir("deepseek")}
    )
    assert [m.pipeline for m in resolved.config.models] == ["llama3", "deepseek"]
    assert main(["validate", "--explain", str(config)]) == 0
    out = capsys.readouterr().out
    assert "g: auto -> llama3 (GGUF general.architecture model_type=llama; special tokens " in out
    assert (
        "d: auto -> deepseek (config.json model_type=qwen2; special tokens <｜begin▁of▁sentence｜>"
        in out
    )


def test_a_converted_gguf_detects_as_the_file_does(tmp_path: Path, shipped: dict[str, Any]) -> None:
    """The server detects on the converted folder; `validate --explain` on the file."""
    from pipeserve.engine.weights.gguf import ensure_converted
    from tests.engine.weights.gguf_fixtures import TEMPLATE, write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    folder = ensure_converted(path, tmp_path / "home")
    with_template = fake_gguf(tmp_path / "meta.gguf", "llama", ["<|endoftext|>", "<|im_start|>",
                                                                  "<|im_end|>"], TEMPLATE)  # fmt: skip
    assert detect_pipeline(read_evidence(folder), shipped).pipeline == "chatml"
    assert detect_pipeline(read_evidence(path), shipped).pipeline == "chatml"
    assert detect_pipeline(read_evidence(with_template), shipped).pipeline == "chatml"


def test_a_gguf_with_pipeline_auto_is_served_by_its_family(tmp_path: Path) -> None:
    """The server's own path: the GGUF is converted, detected as Llama 3 by its control
    tokens, and its calls are parsed by the llama3 pipeline."""
    import httpx

    from pipeserve.loading import build_app_from_config
    from tests.engine.weights.gguf_fixtures import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "llama31.gguf", specials=tuple(LLAMA31))
    completion = 'Sure.<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}'
    config = tmp_path / "auto.yaml"
    config.write_text(
        f"pipelines_dir: {REPO / 'pipelines'}\n"
        "models:\n"
        f"  - {{name: g, source: '{gguf}', pipeline: auto, engine: replay,\n"
        f"     replay: {{completion: '{completion}'}}}}\n"
        "endpoints:\n  - {route: /v1/chat/completions, api: openai-chat}\n"
    )
    app = build_app_from_config(config)
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    body = {"model": "g", "messages": [{"role": "user", "content": "time?"}], "tools": [tool]}
    with httpx.Client(transport=httpx.WSGITransport(app=app), base_url="http://t") as client:
        choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": '{"tz": "UTC"}'}
