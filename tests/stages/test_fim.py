"""Fill-in-the-middle prompts (stages/fim.py through render_template) on the real
tokenizers: the qwen3 demo vocabulary (Qwen2.5-Coder's FIM tokens, same ids), SmolLM2
(no FIM tokens) and styles found in made-up vocabularies."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipeserve.engine.base import ModelRuntime
from pipeserve.errors import ApiError
from pipeserve.request import FillInMiddle, GenerationRequest, RawPrompt
from pipeserve.stages.base import BuildEnv, Chain, RequestContext, Stage
from pipeserve.stages.fim import FIM_STYLES, find_fim_tokens
from pipeserve.stages.render_template import RenderParams, render_template

PREFIX = "def fib(n):\n    if n < 2:\n        return n\n    "
SUFFIX = "\n\nprint(fib(10))  # 日本語 <|im_end|>\n"


def stage_for(tokenizer: Any, context_length: int | None = None) -> Stage:
    runtime = ModelRuntime("m", "qwen3", Path("."), tokenizer, None, frozenset(), context_length)  # type: ignore[arg-type]
    return render_template(RenderParams(), BuildEnv("m", "qwen3", runtime))


def fim_context(stage: Stage, prefix: str | list[int], fim: FillInMiddle) -> RequestContext:
    raw = RawPrompt(token_ids=prefix, fim=fim) if isinstance(prefix, list) else None
    raw = raw or RawPrompt(text=str(prefix), fim=fim)
    ctx = RequestContext(GenerationRequest("m", [], raw_prompt=raw), "req", "m")
    stage.prepare(ctx)
    return ctx


@pytest.fixture(scope="module")
def qwen(demo_tokenizer: Callable[[str], Any]) -> Any:
    return demo_tokenizer("qwen3")


def test_the_plain_layout_is_qwen2_5_coder_s_documented_one(qwen: Any) -> None:
    ctx = fim_context(stage_for(qwen), PREFIX, FillInMiddle(SUFFIX))
    hf = qwen._tokenizer
    style = FIM_STYLES[0]
    pre, suf, mid = (
        hf.convert_tokens_to_ids(t) for t in (style.prefix, style.suffix, style.middle)
    )
    code = [
        hf.encode(t, add_special_tokens=False, split_special_tokens=True) for t in (PREFIX, SUFFIX)
    ]
    assert ctx.prompt_token_ids == [pre, *code[0], suf, *code[1], mid]
    assert ctx.prompt == f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"
    # the documented text, tokenized as a whole, is the same ids: no merge across the marks
    # (the code holds no special-token spelling here)
    plain = SUFFIX.replace("<|im_end|>", "")
    documented = hf.encode(f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{plain}<|fim_middle|>")
    assert fim_context(stage_for(qwen), PREFIX, FillInMiddle(plain)).prompt_token_ids == documented


def test_special_spellings_in_the_code_stay_text(qwen: Any) -> None:
    ids = fim_context(
        stage_for(qwen), "<|fim_middle|>", FillInMiddle("<|im_end|>")
    ).prompt_token_ids
    hf = qwen._tokenizer
    specials = {hf.convert_tokens_to_ids(t) for t in ("<|im_end|>",)} | {151660}
    assert ids is not None and [t for t in ids if t in specials] == [151660]  # the layout's own


def test_the_middle_ends_at_the_style_s_end_and_separator_tokens(qwen: Any) -> None:
    ctx = fim_context(stage_for(qwen), "a", FillInMiddle("b"))
    hf = qwen._tokenizer
    ends = ("<|fim_pad|>", "<|endoftext|>", "<|repo_name|>", "<|file_sep|>")
    expected = {hf.convert_tokens_to_ids(t) for t in ends}
    assert ctx.stop_token_ids == expected


def test_token_id_prefixes_and_an_empty_prefix(qwen: Any) -> None:
    hf = qwen._tokenizer
    by_ids = fim_context(stage_for(qwen), hf.encode(PREFIX), FillInMiddle(SUFFIX))
    by_text = fim_context(stage_for(qwen), PREFIX, FillInMiddle(SUFFIX))
    assert by_ids.prompt_token_ids == by_text.prompt_token_ids
    empty = fim_context(stage_for(qwen), "", FillInMiddle("x")).prompt_token_ids
    assert empty == [151659, 151661, hf.encode("x")[0], 151660]


def test_llama_cpp_repo_level_layout(qwen: Any) -> None:
    """llama.cpp's format_infill: repo name, each extra file after a file separator, the
    current file's separator, then PRE prefix prompt SUF suffix MID."""
    fim = FillInMiddle(
        "}", repo_level=True, extra=(("util.py", "X = 1\n"), ("b.py", "")), prompt="ret"
    )
    ctx = fim_context(stage_for(qwen), "f() {", fim)
    expected = (
        "<|repo_name|>myproject\n<|file_sep|>util.py\nX = 1\n<|file_sep|>b.py\n"
        "<|file_sep|>filename\n<|fim_prefix|>f() {ret<|fim_suffix|>}<|fim_middle|>"
    )
    assert ctx.prompt == expected
    assert ctx.prompt_token_ids == qwen._tokenizer.encode(expected)


def test_llama_cpp_truncation(qwen: Any) -> None:
    """The prefix keeps its last 1536 tokens, the suffix its first 510 less the prompt,
    the extra context its last n_ctx - 2046 tokens (at 2046: none; at 2049: three)."""
    long = "x " * 3000
    fim = FillInMiddle(long, repo_level=True, extra=(("a", "y"),), prompt="z")
    hf = qwen._tokenizer
    x, z = hf.encode(long), hf.encode("z")
    assert len(x) > 1536 and len(z) == 1
    expected = [151659, *x[-1536:], *z, 151661, *x[: 510 - 1], 151660]
    assert fim_context(stage_for(qwen, 2046), long, fim).prompt_token_ids == expected
    ids = fim_context(stage_for(qwen, 2049), long, fim).prompt_token_ids
    assert ids == [151664, *hf.encode("filename\n")][-3:] + expected


def test_a_vocabulary_without_fim_tokens_is_a_400_naming_the_field(
    demo_tokenizer: Callable[[str], Any],
) -> None:
    stage = stage_for(demo_tokenizer("kimi"))
    with pytest.raises(ApiError) as error:
        fim_context(stage, "a", FillInMiddle("b", param="input_suffix"))
    assert error.value.kind == "invalid_request" and error.value.param == "input_suffix"
    assert "cannot fill in the middle" in error.value.message
    assert "insert" not in Chain([stage], ["render"]).capabilities()
    assert "insert" in Chain([stage_for(demo_tokenizer("qwen3"))], ["render"]).capabilities()


def test_smollm2_has_no_fim_tokens(smollm2: tuple[Path, Path]) -> None:
    from pipeserve.engine.weights.loader import load_tokenizer

    assert find_fim_tokens(load_tokenizer(smollm2[1])._tokenizer.get_vocab()) is None


@pytest.mark.parametrize("style", FIM_STYLES, ids=[s.name for s in FIM_STYLES])
def test_styles_are_found_in_the_vocabulary_as_data(style: Any) -> None:
    vocab = {"a": 0, style.prefix: 7, style.suffix: 8, style.middle: 9}
    extra = style.ends + style.file_sep[:1]
    vocab |= {name: 20 + i for i, name in enumerate(extra)}
    found = find_fim_tokens(vocab)
    assert found is not None and found.style == style.name
    assert (found.prefix, found.suffix, found.middle) == (7, 8, 9)
    assert found.ends == frozenset(range(20, 20 + len(extra)))
    del vocab[style.middle]
    assert find_fim_tokens(vocab) is None
