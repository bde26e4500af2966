"""options.speculative: what validation accepts, and positioned errors for what it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.config.one_model import one_model_config, validate


def write_config(tmp_path: Path, options: str, extra_model: str = "") -> Path:
    return one_model_config(tmp_path / "speculative.yaml", f" {options}", extra_model=extra_model)


def test_prompt_lookup_validates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    options = "{speculative: {method: prompt_lookup, tokens: 5, ngram_min: 1, ngram_max: 3}}"
    assert validate(write_config(tmp_path, options), capsys) == (0, "")


def test_tokens_max_follows_a_larger_start_unless_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    options = "{speculative: {method: prompt_lookup, tokens: 20, prediction_tokens: 24}}"
    assert validate(write_config(tmp_path, options), capsys) == (0, "")


SMALL = "  - {name: small, source: 'demo:qwen3', pipeline: qwen3}\n"
SHARDED_SMALL = (
    "  - {name: small, source: 'demo:qwen3', pipeline: qwen3, options: {sharding: {ranks: 2}}}\n"
)
REPLAYED_SMALL = "  - {name: small, source: 'demo:qwen3', pipeline: qwen3, engine: replay}\n"


def test_draft_model_validates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    options = "{speculative: {method: draft, draft: small, tokens: 3}}"
    assert validate(write_config(tmp_path, options, SMALL), capsys) == (0, "")


@pytest.mark.parametrize(
    ("options", "extra", "where", "message"),
    [
        ("{speculative: {method: prompt_lookup, ngram_min: 5, ngram_max: 2}}", "",
         "models[0].options.speculative", "ngram_min 5 is above ngram_max 2"),
        ("{speculative: {method: prompt_lookup, tokens: 9, tokens_max: 7}}", "",
         "models[0].options.speculative", "tokens 9 is above tokens_max 7"),
        ("{speculative: {method: prompt_lookup, prediction_tokens: 9, tokens_max: 8}}", "",
         "models[0].options.speculative", "prediction_tokens 9 is above tokens_max 8"),
        ("{speculative: {method: lookahead}}", "",
         "models[0].options.speculative.method", "prompt_lookup"),
        ("{speculative: {method: prompt_lookup, tokens: 0}}", "",
         "models[0].options.speculative.tokens", "greater than or equal to 1"),
        ("{speculative: {method: draft}}", "",
         "models[0].options.speculative", "needs `draft`"),
        ("{speculative: {method: draft, draft: nowhere}}", "",
         "models[0].options.speculative.draft", "'nowhere' is not a model of this config"),
        ("{speculative: {method: draft, draft: x}}", "",
         "models[0].options.speculative.draft", "a model cannot be its own draft"),
        ("{speculative: {method: draft, draft: small}}", SHARDED_SMALL,
         "models[0].options.speculative.draft", "draft model 'small' is sharded"),
        ("{speculative: {method: draft, draft: small}}", REPLAYED_SMALL,
         "models[0].options.speculative.draft", "'small' is a replay model"),
        ("{sharding: {ranks: 2}, speculative: {method: draft, draft: small}}", SMALL,
         "models[0].options.speculative", "not available for a sharded model"),
        ("{sharding: {ranks: 2}, speculative: {method: prompt_lookup}}", "",
         "models[0].options.speculative", "not available for a sharded model"),
    ],
)  # fmt: skip
def test_refused_with_position_and_reason(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    options: str,
    extra: str,
    where: str,
    message: str,
) -> None:
    code, err = validate(write_config(tmp_path, options, extra), capsys)
    assert code != 0
    line = next(line for line in err.splitlines() if where in line)
    assert message in line and ":" in line.split(where)[0], err
