"""GGUF -> mlx-lm conversion on tiny generated GGUF files: every supported architecture
and tensor type gives the logits of an independent numpy implementation (gguf-py's
dequantization, llama.cpp's rope conventions), and every unsupported input is one
clear error."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from pipeserve.engine.weights.gguf import GgufError, ensure_converted
from pipeserve.engine.weights.loader import load_model, load_tokenizer
from tests.engine.weights.gguf_fixtures import write_tiny_gguf
from tests.engine.weights.gguf_reference import NumpyLlama, transformers_tokenizer

pytestmark = pytest.mark.mlx

TOKENS = [1, 40, 70, 200, 265, 88, 2, 150, 90, 91, 92, 266, 20, 5]

CASES = [
    ("llama", T.Q8_0, True),
    ("llama", T.Q4_1, False),
    ("qwen2", T.Q4_0, True),
    ("qwen2", T.F16, False),
    ("qwen3", T.Q4_1, True),
    ("qwen3", T.F32, False),
    ("llama", T.BF16, False),
]


def _mlx_logits(model: object, tokens: list[int]) -> np.ndarray:
    import mlx.core as mx

    logits = model(mx.array([tokens]))  # type: ignore[operator]
    return np.array(logits[0].astype(mx.float32))


@pytest.mark.parametrize(("arch", "qtype", "tied"), CASES)
def test_converted_model_matches_numpy_reference(
    tmp_path: Path, arch: str, qtype: T, tied: bool
) -> None:
    import mlx_lm

    gguf = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, qtype, tied=tied)
    folder = ensure_converted(gguf, tmp_path / "home")
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == arch
    assert config["tie_word_embeddings"] is tied
    reference = NumpyLlama(gguf).forward(TOKENS)
    quantized, _ = mlx_lm.load(str(folder))  # mlx-lm's own loader, weights as stored
    float32 = load_model(folder, "float32")  # pipeserve's CPU layout (dequantized)
    kernels = load_model(folder, "auto")  # the CPU kernels on the blocks as stored
    scale = np.abs(reference).max()
    # float32: the same arithmetic up to summation order. The CPU kernels round each
    # activation to an int16 per run of 8 values (measured up to 3.3e-4 of the largest
    # logit on these random weights, ~1.3e-4 on SmolLM2). Quantized as stored: MLX's
    # kernels dequantize with the float16 scales (about 1% off on these random weights).
    for logits, tolerance in (
        (_mlx_logits(float32, TOKENS), 2e-5),
        (_mlx_logits(kernels, TOKENS), 1e-3),
        (_mlx_logits(quantized, TOKENS), 3e-2),
    ):
        assert np.abs(logits - reference).max() < tolerance * scale
        assert (logits.argmax(-1) == reference.argmax(-1)).all()


@pytest.mark.parametrize("kernels", ["on", "off"])
def test_auto_layout_on_the_cpu_and_quantized_keeps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: str
) -> None:
    """auto: the CPU kernels on the blocks as stored, or (PIPESERVE_CPU_KERNELS=off, no
    compiler) dequantized float32; `quantized` keeps MLX's own quantized layers."""
    from mlx import nn

    from pipeserve.engine import cpu_kernels
    from pipeserve.engine.cpu_kernels.build import missing_tools
    from pipeserve.engine.cpu_kernels.layers import KernelLinear

    if kernels == "on" and (missing_tools() or cpu_kernels.forced_off()):
        pytest.skip("the CPU kernels cannot be built here or are switched off")
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, kernels)
    folder = ensure_converted(write_tiny_gguf(tmp_path / "m.gguf"), tmp_path / "home")
    auto = load_model(folder, "auto")
    kept = load_model(folder, "quantized")
    kinds = {type(m) for _, m in auto.named_modules()}
    assert nn.QuantizedLinear not in kinds
    assert (KernelLinear if kernels == "on" else nn.Linear) in kinds
    assert nn.QuantizedLinear in {type(m) for _, m in kept.named_modules()}
    ref = NumpyLlama(tmp_path / "m.gguf").forward(TOKENS)
    assert (_mlx_logits(auto, TOKENS).argmax(-1) == ref.argmax(-1)).all()


STRINGS = [
    "the theater",
    " the 12 apples",
    "in 2024, 1234567 items",
    "<|im_start|>user\nhi<|im_end|>",
    "tab\tand  two   spaces\n\n\nnewlines",
    "unicode: héllo wörld — ünïcödé ✓ 日本語 🙂",
    "def f(x):\n    return x ** 2  # square",
    "",
    "   ",
    "<|im_end|><|im_end|>x",
]


def test_tokenizer_matches_transformers_gguf_tokenizer(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "m.gguf", pre="qwen2")
    ours = load_tokenizer(ensure_converted(gguf, tmp_path / "home"))
    theirs = transformers_tokenizer(gguf)
    for text in STRINGS:
        expected = theirs.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special_tokens=False) == expected, text
        assert ours.decode(expected) == text


def test_chat_template_and_special_tokens_come_from_the_file(tmp_path: Path) -> None:
    folder = ensure_converted(write_tiny_gguf(tmp_path / "m.gguf"), tmp_path / "home")
    tokenizer = load_tokenizer(folder)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.encode("<|im_end|>", add_special_tokens=False) == [2]


def test_conversion_is_cached_by_content_hash(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "m.gguf")
    first = ensure_converted(gguf, tmp_path / "home")
    assert ensure_converted(gguf, tmp_path / "home") == first
    write_tiny_gguf(gguf, seed=1)  # same name, other weights: a new folder
    assert ensure_converted(gguf, tmp_path / "home") != first
    assert not list((tmp_path / "home" / "gguf").glob(".*-build-*"))


def _error(path: Path, home: Path, sha256: str | None = None) -> str:
    with pytest.raises(GgufError) as caught:
        ensure_converted(path, home, sha256)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_unsupported_tensor_type_names_it(tmp_path: Path) -> None:
    iq4 = np.zeros((4, 18), dtype=np.uint8)  # 4 rows of one 32-weight IQ4_NL block
    gguf = write_tiny_gguf(tmp_path / "m.gguf", raw_tensors={"blk.0.extra.weight": (iq4, T.IQ4_NL)})
    message = _error(gguf, tmp_path / "home")
    assert message == (
        f"{gguf}: tensor blk.0.extra.weight has GGUF type IQ4_NL, which is not supported "
        "(supported: F32, F16, BF16, MXFP4, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): "
        "its weights are codebook or ternary entries with no affine form; re-quantize the "
        "model from its original weights to Q4_K / Q5_K / Q8_0 instead"
    )
    assert not (tmp_path / "home" / "gguf").exists() or not any((tmp_path / "home/gguf").iterdir())


def test_unsupported_architecture_names_it(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "m.gguf", arch="rwkv7")
    assert _error(gguf, tmp_path / "home") == (
        f"{gguf}: GGUF architecture 'rwkv7' is not supported (supported: llama, qwen2, "
        "qwen3, gemma3, gemma2, phi3, granite, olmo2, glm4, gpt-oss, smollm3, qwen2moe, qwen3moe, bert, nomic-bert)"
    )


def test_unknown_pre_tokenizer_is_an_error(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "m.gguf", pre="made-up")
    assert _error(gguf, tmp_path / "home").startswith(
        f"{gguf}: tokenizer.ggml.pre 'made-up' is not supported (supported: "
    )


def test_missing_file_wrong_hash_and_not_gguf(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert (
        _error(tmp_path / "none.gguf", home) == f"GGUF file {tmp_path / 'none.gguf'} does not exist"
    )
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    assert _error(fake, home) == f"{fake} is not a GGUF file (no GGUF magic at its start)"
    gguf = write_tiny_gguf(tmp_path / "m.gguf")
    message = _error(gguf, home, sha256="0" * 64)
    assert message.startswith(f"{gguf}: sha256 is ") and message.endswith("expects " + "0" * 64)


def test_truncated_file_is_refused_at_load_naming_the_tensor(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "m.gguf")
    data = gguf.read_bytes()
    gguf.write_bytes(data[:-100])
    message = _error(gguf, tmp_path / "home")
    assert message.startswith(f"{gguf}: tensor output_norm.weight (F32, 64) needs 256 bytes ")
    assert message.endswith("(its size does not match its shape: a truncated or corrupt file)")


def test_longrope_with_another_attention_factor_is_refused() -> None:
    """mlx-lm's SuScaledRoPE derives Phi-3's attention factor from the two context
    lengths: a file whose own factor is another is refused, naming both."""
    from pipeserve.engine.weights.gguf.architectures import ARCHITECTURES
    from pipeserve.engine.weights.gguf.model_config import _longrope

    factors = {"rope_factors_long": np.full(4, 2.0), "rope_factors_short": np.ones(4)}
    meta = {"phi3.rope.scaling.original_context_length": 64}
    config = {"max_position_embeddings": 4096}
    good = _longrope({**meta, "phi3.rope.scaling.attn_factor": 2**0.5}, "phi3",
                     ARCHITECTURES["phi3"], factors, config)  # fmt: skip
    assert good["rope_scaling"]["long_factor"] == [2.0] * 4
    assert good["original_max_position_embeddings"] == 64
    with pytest.raises(GgufError, match="attention factor 1.2"):
        _longrope({**meta, "phi3.rope.scaling.attn_factor": 1.2}, "phi3", ARCHITECTURES["phi3"],
                  factors, config)  # fmt: skip
