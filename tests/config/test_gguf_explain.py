"""A config in any folder (no pipelines_dir, no ../pipelines) finds the pipelines shipped
with pipeserve; `validate --explain` reads `.gguf` sources (header only); bad GGUF files
are one line each, with the config position, never a traceback."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from pipeserve.cli import main
from pipeserve.config.pipeline_folder import pipeline_folder, shipped_pipelines
from pipeserve.engine.weights.chat_templates import builtin_templates
from tests.config.shipped import REPO, require_shipped_and_real_stages
from tests.engine.weights.gguf_fixtures import write_tiny_gguf

ENDPOINTS = "endpoints:\n  - {route: /v1/completions, api: openai-completions}\n"


def write_config(folder: Path, models: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = "".join(f"  - {m}\n" for m in models)
    path = folder / "config.yaml"
    path.write_text(f"models:\n{lines}{ENDPOINTS}")
    return path


def test_shipped_pipelines_are_the_repository_s(tmp_path: Path) -> None:
    shipped = {p.name: p.read_text() for p in shipped_pipelines().glob("*.yaml")}
    assert shipped == {p.name: p.read_text() for p in (REPO / "pipelines").glob("*.yaml")}
    assert pipeline_folder(tmp_path / "a" / "c.yaml", None) == shipped_pipelines()
    (tmp_path / "pipelines").mkdir()
    (tmp_path / "a").mkdir()
    assert pipeline_folder(tmp_path / "a" / "c.yaml", None) == tmp_path / "a" / "../pipelines"
    assert pipeline_folder(tmp_path / "a" / "c.yaml", "p") == tmp_path / "a" / "p"


def test_explain_reads_gguf_files_from_a_config_anywhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    require_shipped_and_real_stages()
    chat = write_tiny_gguf(tmp_path / "chat.gguf", "qwen3", T.Q8_0)  # ChatML template, tokens
    base = write_tiny_gguf(tmp_path / "base.gguf", "llama", T.Q4_0, vocab="spm")  # no template
    config = write_config(
        tmp_path / "anywhere" / "deep",
        [f"{{name: c, source: {chat}, pipeline: auto}}",
         f"{{name: b, source: {base}, pipeline: chatml}}",
         f"{{name: t, source: {base}, pipeline: auto, chat_template: gemma}}"],
    )  # fmt: skip
    assert main(["validate", "--explain", str(config)]) == 0
    out = capsys.readouterr().out
    assert (
        "  c: auto -> qwen3 (GGUF general.architecture model_type=qwen3; also matched, weaker: chatml)"
        in out
    )
    assert (
        "    GGUF chat.gguf: architecture qwen3 (mlx-lm qwen3), 0.1M parameters, context 512" in out
    )
    assert "    tensor types: Q8_0 x15, F32 x9\n    chat template: present\n" in out
    assert "  b: pipeline chatml (named in the config); auto would choose chatml (fallback" in out
    assert (
        "    WARNING: no chat template: chat requests will answer 400; set `chat_template:`" in out
    )
    assert "    chat template from the config: gemma" in out
    assert (
        "    memory: weights 0 MiB, KV cache 0.5 MiB per 1024 tokens (512 bytes per token)" in out
    )


def _bad_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    good = write_tiny_gguf(tmp_path / "good.gguf")
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])
    header_cut = tmp_path / "header.gguf"
    header_cut.write_bytes(data[:200])
    magic = tmp_path / "magic.gguf"
    magic.write_bytes(b"GGML" + data[4:])
    unknown = tmp_path / "type.gguf"
    name = b"output_norm.weight"  # a 1-D tensor: name, n_dims u32, one u64 dim, type u32
    at = data.index(name) + len(name) + 4 + 8
    unknown.write_bytes(data[:at] + (99).to_bytes(4, "little") + data[at + 4 :])
    arch = write_tiny_gguf(tmp_path / "arch.gguf", arch="mamba")
    iq = np.zeros((4, 18), dtype=np.uint8)
    iq_file = write_tiny_gguf(tmp_path / "iq.gguf", raw_tensors={"blk.0.x.weight": (iq, T.IQ4_NL)})
    return {
        "cut": (cut, f"{cut}: tensor output_norm.weight (F32, 64) needs 256 bytes but runs "),
        "header": (header_cut, f"{header_cut}: cannot read its GGUF header ({200} bytes): "),
        "magic": (magic, f"{magic} is not a GGUF file (no GGUF magic at its start)"),
        "type": (
            unknown,
            f"{unknown}: cannot read its GGUF header ({len(data)} bytes): tensor "
            "output_norm.weight has GGML type id 99, which is not known",
        ),
        "arch": (arch, f"{arch}: GGUF architecture 'mamba' is not supported (supported: "),
        "iq": (iq_file, f"{iq_file}: tensor blk.0.x.weight has GGUF type IQ4_NL, which is not "),
    }


def test_bad_gguf_files_are_one_line_with_their_config_position(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    require_shipped_and_real_stages()
    bad = _bad_files(tmp_path)
    models = [f"{{name: m{i}, source: {path}, pipeline: chatml}}" for i, (path, _) in
              enumerate(bad.values())]  # fmt: skip
    config = write_config(tmp_path / "cfg", models)
    assert main(["validate", "--explain", str(config)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for i, (_, message) in enumerate(bad.values()):
        line = next(x for x in err.splitlines() if f"models[{i}].source" in x)
        assert line.startswith(f"{config}:{i + 2}:") and message in line, (line, message)


def test_chat_template_option_is_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    require_shipped_and_real_stages()
    base = write_tiny_gguf(tmp_path / "base.gguf", "llama", T.Q4_0, vocab="spm")
    config = write_config(
        tmp_path / "cfg",
        [f"{{name: a, source: {base}, pipeline: chatml, chat_template: gema}}",
         f"{{name: b, source: {base}, pipeline: chatml, chat_template: ./none.jinja}}"],
    )  # fmt: skip
    assert main(["validate", str(config)]) == 1
    err = capsys.readouterr().err
    assert (
        "models[0].chat_template: no built-in chat template 'gema' (built-in: "
        + ", ".join(builtin_templates())
        in err
    )
    assert (
        "models[1].chat_template: chat template file ./none.jinja cannot be read (No such file or directory)"
        in err
    )
