"""options.kv_cache: what validation accepts, and positioned errors naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.config.one_model import one_model_config, validate


def write_config(tmp_path: Path, options: str) -> Path:
    return one_model_config(tmp_path / "kv.yaml", f" {options}")


def test_quantized_cache_validates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the demo models' heads are 16 wide; a local folder with 64-wide heads takes 64
    folder = tmp_path / "wide"
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_size": 256, "num_attention_heads": 4}')
    config = write_config(tmp_path, "{kv_cache: {bits: 4, group_size: 64}}")
    config.write_text(config.read_text().replace("demo:qwen3", str(folder)))
    assert validate(config, capsys) == (0, "")


@pytest.mark.parametrize(
    ("options", "where", "message"),
    [
        ("{kv_cache: {bits: 3}}", "models[0].options.kv_cache.bits", "Input should be 8 or 4"),
        ("{kv_cache: {bits: 8, group_size: 7}}", "models[0].options.kv_cache.group_size",
         "Input should be 32, 64 or 128"),
        ("{kv_cache: 8}", "models[0].options.kv_cache", "valid dictionary"),
        ("{kv_cache: [8, 64]}", "models[0].options.kv_cache", "valid dictionary"),
        ("{kv_cache: {}}", "models[0].options.kv_cache.bits", "Field required"),
        ("{kv_cache: {bits: 8, dtype: int8}}", "models[0].options.kv_cache.dtype",
         "unknown key 'dtype'"),
        ("{kv_cache: {bits: 8, group_size: 32}}", "models[0].options.kv_cache.group_size",
         "group_size 32 does not divide the model's attention head size 16"),
        ("{kv_cache: {bits: 8}, sharding: {ranks: 2}}", "models[0].options.kv_cache",
         "not available for a sharded model"),
    ],
)  # fmt: skip
def test_bad_kv_cache_is_a_positioned_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: str, where: str, message: str
) -> None:
    code, err = validate(write_config(tmp_path, options), capsys)
    assert code == 1
    assert f"{where}: " in err and message in err, err


def test_a_local_gguf_head_size_is_checked_and_explained(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.engine.weights.gguf_fixtures import K_QUANT, write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", dims=K_QUANT)  # 64-wide heads
    for group, code in ((64, 0), (128, 1)):
        config = write_config(tmp_path, f"{{kv_cache: {{bits: 8, group_size: {group}}}}}")
        config.write_text(config.read_text().replace("demo:qwen3", str(gguf)))
        got, err = validate(config, capsys)
        assert got == code and ("head size 64" in err) == bool(code), err
    config.write_text(config.read_text().replace("group_size: 128", "group_size: 64"))
    from pipeserve.cli import main

    assert main(["validate", "--explain", str(config)]) == 0
    out = capsys.readouterr().out
    assert "KV cache quantized (8 bits, group 64)" in out, out
