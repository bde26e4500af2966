"""The protocol-neutral generation request every API decoder produces.

Decoders (one per wire protocol) map client JSON onto these types; stages read them.
Nothing here knows which protocol the client speaks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeAlias, cast

SEED_SPACE = 2**64  # MLX seeds are unsigned 64-bit
MAX_CHOICES = 128  # `n`, as OpenAI's API bounds it

Role: TypeAlias = Literal["system", "user", "assistant", "tool"]
ReasoningEffort: TypeAlias = Literal["minimal", "low", "medium", "high"]
OutputKind: TypeAlias = Literal["json_schema", "json_object", "regex", "lark"]


@dataclass(slots=True)
class ToolCall:
    """A tool call made by the assistant in an earlier turn (arguments is JSON text)."""

    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class Message:
    role: Role
    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None  # on role == "tool": which call this answers
    name: str | None = None  # on role == "tool": the tool's name when known


@dataclass(slots=True)
class ToolSpec:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool = False  # arguments must validate against parameters


@dataclass(slots=True)
class ToolChoice:
    """auto: model decides; none: no calls; required: at least one; function: that one."""

    mode: Literal["auto", "none", "required", "function"] = "auto"
    name: str | None = None


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """What the answer must follow, enforced while decoding (structured output).

    definition: the JSON schema (json_schema), the pattern (regex) or the grammar text
    (lark); None for json_object. param: the request field a compile error names.
    """

    kind: OutputKind
    definition: Any = None
    param: str = "response_format"
    name: str | None = None


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # OpenAI's additive penalties, -2..2
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id of this model -> bias
    seed: int | None = None
    # Names the client left unset (decoders fill it via sampling_params); only these take
    # the model's defaults, so directly built params are used exactly as given.
    unset: frozenset[str] = frozenset()

    def with_defaults(self, defaults: dict[str, float]) -> SamplingParams:
        """These parameters with a model's defaults for those the client did not set."""
        missing = {name: value for name, value in defaults.items() if name in self.unset}
        if not missing:
            return self
        return replace(self, unset=self.unset - set(missing), **cast("dict[str, Any]", missing))


# Parameters a model entry (or its generation_config.json) may give defaults for.
DEFAULTABLE_SAMPLING: tuple[str, ...] = ("temperature", "top_p", "top_k", "min_p",
                                         "repetition_penalty", "presence_penalty",
                                         "frequency_penalty")  # fmt: skip


def sampling_params(**values: Any) -> SamplingParams:
    """SamplingParams from a request's values, None meaning not set (a default applies)."""
    set_values = {name: value for name, value in values.items() if value is not None}
    unset = frozenset(DEFAULTABLE_SAMPLING) - frozenset(set_values)
    return SamplingParams(**set_values, unset=unset)


@dataclass(slots=True)
class ReasoningOptions:
    """enabled None means the family default; effort/budget are hints for templates."""

    enabled: bool | None = None
    effort: ReasoningEffort | None = None
    budget_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class FillInMiddle:
    """Fill-in-the-middle: the raw prompt is the text before the hole, `suffix` the text
    after it (render_template lays both out with the vocabulary's FIM tokens).

    param: the request field an error names (`suffix`, `input_suffix`). repo_level:
    llama.cpp's /infill layout (repository and file-separator tokens before the prefix,
    `extra` files as context, `prompt` after the prefix); False: the model's plain
    prefix-suffix-middle layout. extra: (filename, text) context files (repo_level only).
    """

    suffix: str
    param: str = "suffix"
    repo_level: bool = False
    extra: tuple[tuple[str, str], ...] = ()
    prompt: str = ""


@dataclass(slots=True)
class RawPrompt:
    """A prompt sent as is (legacy Completions, Ollama's `raw`): no chat template is
    applied, and the answer is the model's text as generated (render_template tokenizes
    it; stages that parse output, reasoning or tool calls, are skipped). Exactly one of
    text and token_ids is set. fim: the prompt is the prefix of a fill-in-the-middle
    request (the text is then tokenized without reading special tokens in it)."""

    text: str | None = None
    token_ids: list[int] | None = None
    fim: FillInMiddle | None = None


@dataclass(slots=True)
class GenerationRequest:
    model: str
    messages: list[Message]
    tools: list[ToolSpec] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    reasoning: ReasoningOptions = field(default_factory=ReasoningOptions)
    logprobs: bool = False
    top_logprobs: int = 0
    mock_response: str | None = None  # replay engine only
    parallel_tool_calls: bool = True
    # Client-sent chat-template variables (Chat's chat_template_kwargs), already checked
    # safe by the decoder (api/openai_chat/template_kwargs.py); the pipeline's own kwargs
    # come first.
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Predicted output (Chat's `prediction`): the engine proposes tokens from it.
    prediction: str | None = None
    output_format: OutputFormat | None = None  # structured output (None: free text)
    raw_prompt: RawPrompt | None = None  # set instead of messages by completion protocols
    n: int = 1  # choices (Chat, Completions): decoded together from one prefill

    def choice(self, index: int) -> GenerationRequest:
        """This request for its choice `index`: a copy whose seed stream is the choice's
        own (seed + index; unseeded stays unseeded)."""
        seed = self.sampling.seed
        if seed is None or index == 0:
            return replace(self)
        return replace(self, sampling=replace(self.sampling, seed=(seed + index) % SEED_SPACE))


@dataclass(slots=True)
class TokenizeRequest:
    """`/tokenize`: text (`content`) or a conversation (`chat`, rendered through the
    model's template exactly as generation renders it) to token ids. model: None where
    the protocol lets it out (the route's only model answers)."""

    model: str | None
    content: str | None = None
    chat: GenerationRequest | None = None
    add_special: bool = False  # the tokenizer's BOS (content only)
    parse_special: bool = True  # special-token spellings in content are special tokens
    with_pieces: bool = False  # each id with its text (or its bytes, when not UTF-8)


@dataclass(slots=True)
class DetokenizeRequest:
    """`/detokenize`: token ids to text (special tokens as their text)."""

    model: str | None
    tokens: list[int] = field(default_factory=list)
