"""Model sources, EOS ids, context length and dtype casts."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest

from pipeserve.engine.weights.loader import (
    context_length,
    eos_token_ids,
    load_model,
    load_tokenizer,
    resolve_source,
)


def test_demo_and_local_sources(demo_model_dir):
    path = demo_model_dir("qwen3")
    assert resolve_source("demo:qwen3") == path
    assert resolve_source(str(path)) == path


def test_missing_local_folder_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_source(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_source(str(tmp_path))
    with pytest.raises(ValueError, match="unknown demo model"):
        resolve_source("demo:nonsense")


def test_eos_ids_merge_tokenizer_config_and_generation_config(demo_model_dir, tmp_path):
    model_dir = tmp_path / "m"
    shutil.copytree(demo_model_dir("qwen3"), model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [151644]}))
    tokenizer = load_tokenizer(model_dir)
    assert eos_token_ids(tokenizer, model_dir) == {151643, 151645, 151644}
    assert (
        context_length(model_dir)
        == json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    )


def test_dtype_cast(demo_model_dir):
    model = load_model(demo_model_dir("qwen3"), "float16")
    assert model.model.embed_tokens.weight.dtype == mx.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(demo_model_dir("qwen3"), "int3")


def test_a_preloaded_tokenizer_is_handed_out_once(demo_model_dir, tmp_path):
    """The master's tokenizer (loaded before the fork) serves the first build only: a
    later reload reads the folder again, and a folder without tokenizer.json is skipped."""
    from pipeserve.engine.weights.loader import (
        forget_preloaded_tokenizers,
        preload_tokenizers,
        take_preloaded_tokenizer,
    )

    path = demo_model_dir("qwen3")
    preload_tokenizers([path, tmp_path])
    try:
        tokenizer = take_preloaded_tokenizer(path)
        assert tokenizer is not None
        assert tokenizer.encode("hello world") == load_tokenizer(path).encode("hello world")
        assert take_preloaded_tokenizer(path) is None
        assert take_preloaded_tokenizer(tmp_path) is None
        preload_tokenizers([path])
        forget_preloaded_tokenizers()
        assert take_preloaded_tokenizer(path) is None
    finally:
        forget_preloaded_tokenizers()
