"""What both renderers of render_template share: the stage's parameters and the
pass-through stage that sets the prompt (chat templates: render_template.py; Harmony:
render_harmony.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from pydantic import Field

from pipeserve.errors import ApiError
from pipeserve.events import Event
from pipeserve.request import FillInMiddle, GenerationRequest, RawPrompt
from pipeserve.stages.base import BuildEnv, RequestContext, StageParams
from pipeserve.stages.fim import FimLayout, no_fim_message

MISSING = object()


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
        self._fim: FimLayout | None | object = MISSING

    def render(self, request: GenerationRequest) -> tuple[str, list[int]]:
        raise NotImplementedError

    def prepare(self, ctx: RequestContext) -> None:
        raw = ctx.request.raw_prompt
        if raw is not None and raw.fim is not None:
            prompt, token_ids = self.fill_in_middle(raw, raw.fim, ctx)
        else:
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
        tokenizer = self.tokenizer()
        if raw.token_ids is None:
            text = raw.text or ""
            return text, list(tokenizer.encode(text))
        self.check_ids(raw.token_ids)
        return tokenizer.decode(raw.token_ids), list(raw.token_ids)

    def fim_layout(self) -> FimLayout | None:
        """The tokenizer's FIM layout (found once), None without FIM tokens."""
        if self._fim is MISSING:
            self._fim = FimLayout.of(self.tokenizer())
        return self._fim if isinstance(self._fim, FimLayout) else None

    @property
    def capabilities(self) -> frozenset[str]:
        """`insert` (Ollama's name) where the vocabulary can fill in the middle."""
        if self.env.runtime is None:
            return frozenset()
        return frozenset({"insert"}) if self.fim_layout() is not None else frozenset()

    def fill_in_middle(
        self, raw: RawPrompt, fim: FillInMiddle, ctx: RequestContext
    ) -> tuple[str, list[int]]:
        """The FIM prompt (stages/fim.py); a 400 naming fim.param without FIM tokens."""
        layout = self.fim_layout()
        if layout is None:
            message = no_fim_message(self.env.model_name, fim.param)
            raise ApiError("invalid_request", message, fim.param)
        prefix = list(raw.token_ids) if raw.token_ids is not None else layout.code(raw.text or "")
        self.check_ids(prefix)
        context = self.env.runtime.context_length if self.env.runtime else None
        token_ids = layout.prompt(prefix, fim, context)
        ctx.stop_token_ids = layout.tokens.ends
        return self.tokenizer().decode(token_ids), token_ids

    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer."""
        runtime = self.env.runtime
        if runtime is None:
            raise ApiError("unavailable", f"Model {self.env.model_name!r} is not loaded.")
        return getattr(runtime.tokenizer, "_tokenizer", runtime.tokenizer)

    def check_ids(self, token_ids: list[int]) -> None:
        size = len(self.tokenizer())
        outside = sorted({t for t in token_ids if not 0 <= t < size})
        if outside:
            message = f"token ids {outside[:5]} are outside this model's vocabulary (0-{size - 1})."
            raise ApiError("invalid_request", message, "prompt")

    def __call__(self, events: Iterator[Event], ctx: RequestContext) -> Iterator[Event]:
        return events
