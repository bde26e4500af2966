"""Chat's `chat_template_kwargs` (the vLLM / SGLang request extra): which client-sent
chat-template variables are safe to forward, and the reasoning switches among them.

`enable_thinking` and `thinking` (booleans) set reasoning on or off, so the thinking
stage knows whether the prompt opened a think block; `reasoning_effort` is an effort like
Chat's own field. Any other variable reaches the template only if it is safe: a plain
identifier that is neither one of the renderer's own arguments (`tokenize`,
`chat_template`, ...) nor a variable the renderer sets (`messages`, `tools`,
`bos_token`, ...), whose value is a JSON scalar (string up to MAX_TEXT characters) or a
short list of them. Anything else is a 400 naming the key: a variable the server would
silently drop could change the answer the client expects.
"""

from __future__ import annotations

import re
from typing import Any

from pipeserve.api.openai_common import check, reasoning_options
from pipeserve.request import ReasoningOptions

PARAM = "chat_template_kwargs"
MAX_TEXT = 4096
MAX_ITEMS = 64
_IDENTIFIER = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
# apply_chat_template's own arguments and the variables it defines for the template.
RESERVED = frozenset(
    {
        "messages", "conversation", "tools", "documents", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length",
        "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
        "chat_template", "bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
        "cls_token", "mask_token", "additional_special_tokens", "raise_exception",
        "strftime_now", "kwargs",
    }
)  # fmt: skip
THINKING_SWITCHES = ("enable_thinking", "thinking")


def decode_template_kwargs(
    raw: Any, reasoning: ReasoningOptions
) -> tuple[dict[str, Any], ReasoningOptions]:
    """The variables to forward, and `reasoning` updated by the switches among them."""
    if raw is None:
        return {}, reasoning
    check(isinstance(raw, dict), PARAM, "expected an object")
    kwargs: dict[str, Any] = {}
    for name, value in raw.items():
        where = f"{PARAM}.{name}"
        check(_IDENTIFIER.fullmatch(name) is not None, PARAM, f"{name!r} is not a plain name")
        check(name not in RESERVED, where, "set by the server's chat-template renderer")
        check(_safe_value(value), where, "expected a string, number, boolean, null or a short list")
        kwargs[name] = value
    for name in THINKING_SWITCHES:
        if name in kwargs:
            check(isinstance(kwargs[name], bool), f"{PARAM}.{name}", "expected a boolean")
            reasoning.enabled = kwargs[name]
    effort = kwargs.get("reasoning_effort")
    if effort is not None:
        check(isinstance(effort, str), f"{PARAM}.reasoning_effort", "expected a string")
        chosen = reasoning_options(effort, f"{PARAM}.reasoning_effort")
        reasoning.effort = chosen.effort
        if chosen.enabled is False:
            reasoning.enabled = False
    return kwargs, reasoning


def _safe_value(value: Any) -> bool:
    if isinstance(value, list):
        return len(value) <= MAX_ITEMS and all(_scalar(item) for item in value)
    return _scalar(value)


def _scalar(value: Any) -> bool:
    if isinstance(value, str):
        return len(value) <= MAX_TEXT
    return value is None or isinstance(value, (bool, int, float))


__all__ = ["RESERVED", "decode_template_kwargs"]
