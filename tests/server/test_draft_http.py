"""A served model with a draft, over HTTP with the OpenAI SDK: its greedy answer is the
draft-free model's own (the draft is the same demo model: its proposals are accepted,
as the request log shows), and a model whose draft has another tokenizer answers 503
with the reason while the others keep serving."""

from __future__ import annotations

import re
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from tests.server.serverproc import REPO, server_log, server_process

pytestmark = pytest.mark.server

MODELS = """\
  - name: drafted
    source: demo:qwen3
    pipeline: qwen3
    options: {speculative: {method: draft, draft: plain, tokens: 3}}
  - {name: plain, source: 'demo:qwen3', pipeline: qwen3}
  - name: mismatched
    source: demo:qwen3
    pipeline: qwen3
    load: on_demand
    options: {speculative: {method: draft, draft: other, tokens: 3}}
  - {name: other, source: 'demo:kimi', pipeline: kimi, load: on_demand}
"""


def answer(client: OpenAI, model: str) -> str:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Count: one two three one two three one two"}],
        max_tokens=24,
        temperature=0,
    )
    return reply.choices[0].message.content or ""


def test_draft_served_and_a_mismatched_draft_refused(tmp_path: Path) -> None:
    config = tmp_path / "draft.yaml"
    config.write_text(
        f"pipelines_dir: {REPO / 'pipelines'}\nmodels:\n{MODELS}"
        "endpoints:\n  - {route: /v1/chat/completions, api: openai-chat}\n"
    )
    with server_process(config) as (base, _):
        client = OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0)
        expected = answer(client, "plain")
        assert answer(client, "drafted") == expected
        with pytest.raises(openai.APIStatusError) as refused:
            answer(client, "mismatched")
        assert refused.value.status_code == 503
        assert "draft model 'other' does not share its tokenizer" in str(refused.value)
        assert answer(client, "drafted") == expected
        log = server_log(base).read_text()
    accepted = [
        (int(a), int(p)) for a, p in re.findall(r"model=drafted .*?speculative=(\d+)/(\d+)", log)
    ]
    assert accepted and all(0 < a <= p for a, p in accepted), accepted
