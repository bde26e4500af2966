"""`pipeline: auto`: the shipped pipelines' detect rules pick each family from its folder."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeserve.cli import main
from pipeserve.config import ConfigError, load_pipeline, load_server_config
from pipeserve.config.auto import resolve_auto
from pipeserve.config.detect import DetectionError, detect_pipeline, read_evidence
from tests.config.shipped import REPO, require_shipped_and_real_stages

FAMILY_PIPELINE = {"qwen3": "qwen3", "glm": "glm", "kimi": "kimi", "gpt-oss": "gpt-oss"}
# (the tool-call families' demo models: tests/config/test_detect_families.py)


@pytest.fixture(scope="module")
def shipped() -> dict[str, Any]:
    require_shipped_and_real_stages()
    return {p.stem: load_pipeline(p) for p in sorted((REPO / "pipelines").glob("*.yaml"))}


def fake_model(
    folder: Path,
    model_type: str,
    tokens: list[str] = (),  # type: ignore[assignment]
    template: str = "",
    architectures: list[str] = (),  # type: ignore[assignment]
) -> Path:
    """A model folder with only what detection reads: config.json and tokenizer files."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": model_type, "architectures": list(architectures)}
    (folder / "config.json").write_text(json.dumps(config))
    decoder = {str(100 + i): {"content": t, "special": True} for i, t in enumerate(tokens)}
    tokenizer_config = {"added_tokens_decoder": decoder, "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return folder


@pytest.mark.parametrize("family", sorted(FAMILY_PIPELINE))
def test_demo_models_detect_as_their_family(
    family: str, demo_model_dir: Callable[[str], Path], shipped: dict[str, Any]
) -> None:
    detection = detect_pipeline(read_evidence(demo_model_dir(family)), shipped)
    assert detection.pipeline == FAMILY_PIPELINE[family]
    assert not detection.fallback and detection.evidence


@pytest.mark.parametrize(
    ("model_type", "tokens", "template", "expected"),
    [
        # Qwen2.5: ChatML tokens, no reasoning tokens -> plain chatml, not qwen3
        ("qwen2", ["<|im_start|>", "<|im_end|>", "<tool_call>"], "", "chatml"),
        # QwQ: a qwen2 config whose vocabulary reasons with <think>
        ("qwen2", ["<|im_start|>", "<|im_end|>", "<think>", "</think>"], "", "qwen3"),
        # Qwen3 MoE by its config alone
        ("qwen3_moe", [], "", "qwen3"),
        # Kimi K2's real config names kimi_k2 (architecture DeepseekV3)
        ("kimi_k2", [], "", "kimi"),
        # GLM-4.6 by config, even though its vocabulary also has <think>
        ("glm4_moe", ["<think>", "</think>", "<tool_call>"], "", "glm"),
        # a ChatML model whose markers are only in its template
        ("mistral", [], "{{ '<|im_start|>' + m.role }}", "chatml"),
    ],
)
def test_rules_pick_the_family(
    tmp_path: Path,
    shipped: dict[str, Any],
    model_type: str,
    tokens: list[str],
    template: str,
    expected: str,
) -> None:
    folder = fake_model(tmp_path / "m", model_type, tokens, template)
    detection = detect_pipeline(read_evidence(folder), shipped)
    assert (detection.pipeline, detection.fallback) == (expected, False)


def test_unknown_family_falls_back_to_chatml_with_warning(
    tmp_path: Path, shipped: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    folder = fake_model(tmp_path / "llama", "llama", ["<|begin_of_text|>", "<|eot_id|>"])
    detection = detect_pipeline(read_evidence(folder), shipped)
    assert detection.pipeline == "chatml" and detection.fallback
    assert "model_type llama" in detection.describe()
    config = write_config(tmp_path, [("m", str(folder), "auto")])
    with caplog.at_level("WARNING", logger="pipeserve.config"):
        resolved = resolve_auto(load_server_config(config), {"m": folder})
    assert resolved.config.models[0].pipeline == "chatml"
    assert any("fallback" in r.message and r.levelname == "WARNING" for r in caplog.records)


def test_without_fallback_auto_is_a_positioned_error(tmp_path: Path) -> None:
    pipelines = tmp_path / "pipelines"
    pipelines.mkdir()
    text = (REPO / "pipelines" / "glm.yaml").read_text()
    (pipelines / "glm.yaml").write_text(text)
    folder = fake_model(tmp_path / "llama", "llama")
    config = write_config(tmp_path, [("m", str(folder), "auto")], pipelines)
    loaded = load_server_config(config)
    with pytest.raises(DetectionError):
        detect_pipeline(read_evidence(folder), loaded.pipelines)
    with pytest.raises(ConfigError) as caught:
        resolve_auto(loaded, {"m": folder})
    problem = caught.value.problems[0]
    assert problem.path == "models[0].pipeline" and problem.line == 5


def test_a_bad_detect_rule_is_a_positioned_problem(tmp_path: Path) -> None:
    text = (REPO / "pipelines" / "qwen3.yaml").read_text()
    broken = text.replace("model_type: [qwen3", "model_typ: [qwen3").replace(
        '- {tokens: ["<|im_start|>"', '- {}\n    - {tokens: ["<|im_start|>"'
    )
    path = tmp_path / "pipelines" / "qwen3.yaml"
    path.parent.mkdir()
    path.write_text(broken)
    assert main(["validate", str(path)]) == 1
    with pytest.raises(ConfigError) as caught:
        load_pipeline(path)
    messages = [str(p) for p in caught.value.problems]
    assert any(
        "detect.rules[0].model_typ" in m and "did you mean 'model_type'" in m for m in messages
    )
    assert any("detect.rules[1]" in m and "at least one of" in m for m in messages)


def test_validate_explain_prints_choice_and_evidence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], demo_model_dir: Callable[[str], Path]
) -> None:
    demo_model_dir("glm")
    folder = fake_model(tmp_path / "llama", "llama")
    glm_like = fake_model(tmp_path / "glm", "glm4_moe")
    config = write_config(
        tmp_path,
        [("g", "demo:glm", "auto"), ("l", str(folder), "auto"), ("q", str(glm_like), "qwen3")],
    )
    assert main(["validate", "--explain", str(config)]) == 0
    out = capsys.readouterr().out
    assert "g: auto -> glm (config.json model_type=glm4_moe" in out
    assert "l: auto -> chatml (fallback: no pipeline's detect rules matched" in out
    assert "q: pipeline qwen3 (named in the config); auto would choose glm" in out
    assert "[DIFFERS]" in out


@pytest.fixture
def auto_app(tmp_path: Path) -> Iterator[httpx.Client]:
    from pipeserve.loading import build_app_from_config

    config = tmp_path / "auto.yaml"
    config.write_text(
        f"pipelines_dir: {REPO / 'pipelines'}\n"
        "models:\n"
        "  - {name: g, source: 'demo:glm', pipeline: auto, engine: replay,\n"
        "     replay: {completion: 'weighing it</think>The answer.'}}\n"
        "endpoints:\n  - {route: /v1/chat/completions, api: openai-chat}\n"
    )
    app = build_app_from_config(config)
    with httpx.Client(transport=httpx.WSGITransport(app=app), base_url="http://t") as client:
        yield client


def test_an_auto_model_is_served_by_the_detected_pipeline(auto_app: httpx.Client) -> None:
    body = {"model": "g", "messages": [{"role": "user", "content": "hi"}]}
    message = auto_app.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    # GLM's pipeline opens reasoning in the prompt: the text before </think> is reasoning.
    assert message["content"] == "The answer."
    assert message["reasoning_content"] == "weighing it"


def write_config(
    tmp_path: Path, models: list[tuple[str, str, str]], pipelines: Path | None = None
) -> Path:
    lines = [f"pipelines_dir: {pipelines or REPO / 'pipelines'}", "models:"]
    for name, source, pipeline in models:
        lines += [f"  - name: {name}", f"    source: '{source}'", f"    pipeline: {pipeline}"]
    lines += ["endpoints:", "  - {route: /v1/chat/completions, api: openai-chat}"]
    path = tmp_path / "server.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path
