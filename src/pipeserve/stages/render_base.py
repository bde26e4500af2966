"""What both renderers of render_template share: the stage's parameters and the
pass-through stage that sets the prompt (chat templates: render_template.py; Harmony:
render_harmony.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from pydantic import Field

from pipeserve.errors import ApiError
from pipeserve.events import Event
from pipeserve.request import GenerationRequest, RawPrompt
from pipeserve.stages.base import BuildEnv, RequestContext, StageParams


class RenderParams(StageParams):
    renderer: Literal["chat_template", "harmony"] = Field(
        "chat_template",
        description="chat_template: the tokenizer's chat template; harmony: openai-harmony (GPT-OSS).",
    )
    think_start: str | None = Field(
        None, description="Reasoning start tag; a prompt ending with it opened a think block."
    )
    continue_final_assistant: bool = Field(
        True,
        description="A conversation ending with an assistant message (prefill) is continued "
        "instead of answered in a new turn (chat_template renderer).",
    )
    thinking_switch: str | None = Field(
        "enable_thinking",
        description="The chat template variable that turns reasoning on or off (Qwen3, GLM:"
        " enable_thinking), set when a request says; null when the template has none.",
    )
    system_role: Literal["native", "fold"] = Field(
        "native",
        description="native: system messages go to the template as they are; fold: for "
        "templates without a system role (Gemma), their text opens the first user turn.",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra template variables (harmony: model_identity, knowledge_cutoff, "
        "conversation_start_date).",
    )


class RenderStage:
    """Shared pass-through behaviour; subclasses implement `render`."""

    def __init__(self, params: RenderParams, env: BuildEnv) -> None:
        self.params = params
        self.env = env

    def render(self, request: GenerationRequest) -> tuple[str, list[int]]:
        raise NotImplementedError

    def prepare(self, ctx: RequestContext) -> None:
        raw = ctx.request.raw_prompt
        prompt, token_ids = self.render(ctx.request) if raw is None else self.raw(raw)
        if not token_ids:
            raise ApiError(
                "invalid_request", "The conversation rendered to an empty prompt.", "messages"
            )
        ctx.prompt = prompt
        ctx.prompt_token_ids = token_ids
        start = self.params.think_start
        opened = bool(start and raw is None and prompt.rstrip().endswith(start))
        ctx.prompt_opened_thinking = opened

    def raw(self, raw: RawPrompt) -> tuple[str, list[int]]:
        """A prompt sent as is: tokenized as the tokenizer does by default (with a BOS
        token where the model has one), or token ids checked against the vocabulary."""
        runtime = self.env.runtime
        if runtime is None:
            raise ApiError("unavailable", f"Model {self.env.model_name!r} is not loaded.")
        tokenizer = getattr(runtime.tokenizer, "_tokenizer", runtime.tokenizer)
        if raw.token_ids is None:
            text = raw.text or ""
            return text, list(tokenizer.encode(text))
        size = len(tokenizer)
        outside = sorted({t for t in raw.token_ids if not 0 <= t < size})
        if outside:
            message = f"token ids {outside[:5]} are outside this model's vocabulary (0-{size - 1})."
            raise ApiError("invalid_request", message, "prompt")
        return tokenizer.decode(raw.token_ids), list(raw.token_ids)

    def __call__(self, events: Iterator[Event], ctx: RequestContext) -> Iterator[Event]:
        return events
