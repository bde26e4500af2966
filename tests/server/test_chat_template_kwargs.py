"""Chat's chat_template_kwargs (as Qwen-family clients send to vLLM) reach the chat
template: a real server, the openai SDK's extra_body."""

from __future__ import annotations

import openai
import pytest

from pipeserve.api.openai_chat.template_kwargs import decode_template_kwargs
from pipeserve.request import ReasoningOptions

pytestmark = pytest.mark.server

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def client(replay_server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{replay_server}/v1", api_key="test", max_retries=0)


def prompt_tokens(client: openai.OpenAI, **extra: object) -> int:
    reply = client.chat.completions.create(model="replay-qwen3", messages=HI, extra_body=extra)
    assert reply.choices[0].message.content == "Hello! How can I help you today?"
    assert reply.usage is not None
    return reply.usage.prompt_tokens


def test_enable_thinking_false_closes_the_think_block_in_the_prompt(client: openai.OpenAI) -> None:
    default = prompt_tokens(client)
    off = prompt_tokens(client, chat_template_kwargs={"enable_thinking": False})
    on = prompt_tokens(client, chat_template_kwargs={"enable_thinking": True})
    # Qwen3's template appends an empty `<think>\n\n</think>\n\n` when thinking is off.
    assert on == default and off > default


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tokenize": True}, "chat_template_kwargs.tokenize"),
        ({"chat_template": "{{ 7 * 7 }}"}, "chat_template_kwargs.chat_template"),
        ({"messages": []}, "chat_template_kwargs.messages"),
        ({"enable_thinking": "no"}, "chat_template_kwargs.enable_thinking"),
        ({"nested": {"a": 1}}, "chat_template_kwargs.nested"),
        ({"__class__": 1}, "chat_template_kwargs"),
    ],
)
def test_unsafe_kwargs_are_a_400_naming_them(
    client: openai.OpenAI, kwargs: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        prompt_tokens(client, chat_template_kwargs=kwargs)
    assert error.value.body["param"] == param  # type: ignore[index]


def test_safe_unknown_kwargs_are_forwarded_and_switches_set_reasoning() -> None:
    kwargs, reasoning = decode_template_kwargs(
        {"thinking": False, "custom_instructions": "Be terse.", "tags": ["a", 1]},
        ReasoningOptions(),
    )
    assert kwargs == {"thinking": False, "custom_instructions": "Be terse.", "tags": ["a", 1]}
    assert reasoning.enabled is False
    _, effort = decode_template_kwargs({"reasoning_effort": "max"}, ReasoningOptions())
    assert effort.effort == "high" and effort.enabled is None
