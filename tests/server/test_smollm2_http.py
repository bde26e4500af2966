"""The shipped default model over HTTP, as the README uses it: SmolLM2-135M-Instruct
answers "Paris" on all three APIs with the server's default sampling, its greedy output
equals mlx-lm's own generation on the converted folder token for token, and the model's
sampling defaults apply to what a request leaves out."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from anthropic import Anthropic
from openai import OpenAI

from tests.server.serverproc import REPO, running_server

pytestmark = [pytest.mark.server, pytest.mark.mlx]

QUESTION = "What is the capital of France?"
PROMPTS = [QUESTION, "Write a haiku about the sea.", "Name three colours of the rainbow."]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def server(smollm2: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """configs/default.yaml as shipped, plus the same model kept quantized (mlx-lm's layout)."""
    config = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    shipped = config["models"][0]
    quantized = {**shipped, "name": "smollm2-quantized", "aliases": [],
                 "options": {**shipped.get("options", {}), "dtype": "quantized"}}  # fmt: skip
    config["models"].append(quantized)
    config["pipelines_dir"] = str(REPO / "pipelines")
    path = tmp_path_factory.mktemp("smollm2") / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    with running_server(path) as base:
        yield base


def test_paris_on_all_three_apis_with_default_sampling(server: str) -> None:
    openai = OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)
    claude = Anthropic(base_url=server, api_key="x", max_retries=0)
    question = [{"role": "user", "content": QUESTION}]
    chat = openai.chat.completions.create(model="smollm2", messages=question, max_tokens=16)
    messages = claude.messages.create(model="demo", max_tokens=16, messages=question)
    response = openai.responses.create(model="smollm2", input=QUESTION, max_output_tokens=16)
    assert "Paris" in (chat.choices[0].message.content or "")
    assert "Paris" in messages.content[0].text  # type: ignore[union-attr]
    assert "Paris" in response.output_text


def test_greedy_http_equals_mlx_lm_generate(server: str, smollm2: tuple[Path, Path]) -> None:
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(smollm2[1]))
    openai = OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        expected = mlx_lm.generate(model, tokenizer, ids, max_tokens=MAX_TOKENS)
        reply = openai.chat.completions.create(
            model="smollm2-quantized", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"repetition_penalty": 1.0},  # plain greedy, as mlx_lm.generate
        )  # fmt: skip
        assert reply.choices[0].message.content == expected, prompt
        assert reply.usage is not None
        assert reply.usage.completion_tokens <= MAX_TOKENS


def test_model_sampling_defaults_apply_and_request_values_win(server: str) -> None:
    openai = OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": PROMPTS[1]}]

    def ask(**sampling: float) -> str | None:
        reply = openai.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=MAX_TOKENS, extra_body=sampling
        )
        return reply.choices[0].message.content

    shipped = ask()  # configs/default.yaml: temperature 0, repetition_penalty 1.1
    assert shipped == ask(temperature=0, repetition_penalty=1.1)
    assert shipped != ask(temperature=0, repetition_penalty=1.0)


def test_prediction_keeps_the_answer_and_reports_accepted_tokens(server: str) -> None:
    """Chat's Predicted Outputs: a right prediction is accepted (usage says how much), a
    wrong one is rejected; the answer is the same either way (greedy, with the shipped
    repetition penalty, so the row takes the processors' path)."""
    openai = OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]

    def ask(prediction: str | None) -> tuple[str | None, object]:
        extra = {"prediction": {"type": "content", "content": prediction}} if prediction else {}
        reply = openai.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=24, extra_body=extra
        )
        return reply.choices[0].message.content, reply.usage

    plain, _ = ask(None)
    assert plain
    right, usage = ask(plain)
    wrong, wrong_usage = ask("SELECT name FROM users WHERE id = 1;")
    assert right == wrong == plain
    details = usage.completion_tokens_details  # type: ignore[attr-defined]
    assert details.accepted_prediction_tokens > 0
    wrong_details = wrong_usage.completion_tokens_details  # type: ignore[attr-defined]
    assert wrong_details.accepted_prediction_tokens < details.accepted_prediction_tokens
    # OpenAI's rejected: the prediction's tokens absent from the completion. The right
    # one is the answer itself; the SQL line shares (nearly) nothing with it.
    assert details.rejected_prediction_tokens < wrong_details.rejected_prediction_tokens
    assert wrong_details.rejected_prediction_tokens >= 5
