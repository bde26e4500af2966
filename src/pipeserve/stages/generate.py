"""generate: submit the rendered prompt to the model's engine and stream its events.

prepare (before the response starts, so failures become 4xx / 429 / 529):
  prompt ids = ctx.prompt_token_ids + the tokenized ctx.assistant_prefill; the context
  length is checked; max_tokens defaults and is capped (by the model's max_tokens_limit
  and the room left in the context); the job goes to the engine (unless ctx.dry_run)
  and ctx.cancel() is wired to the stream's cancel().
__call__: upstream events pass through, then the engine's PromptReady, TokenText...,
  Finish, Usage (KeepAlive while nothing happens). The prefill is not re-emitted:
  the tool_calls stage starts its parser in the prefilled state.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pydantic import Field

from pipeserve.constraint import GrammarPlan
from pipeserve.engine.base import GenerationJob, ModelRuntime, ThinkingLimit
from pipeserve.engine.sampling.grammar import Constraint, GrammarError
from pipeserve.errors import ApiError, ContextLengthError
from pipeserve.events import Event, TokenText
from pipeserve.gevent_support import run_off_hub
from pipeserve.request import GenerationRequest, SamplingParams
from pipeserve.stages.base import BuildEnv, RequestContext, StageParams, register_stage
from pipeserve.stages.grammar_plan import response_grammar

DEFAULT_KEEPALIVE = 5.0


class GenerateParams(StageParams):
    keepalive_interval: float | None = Field(
        None,
        gt=0,
        description="Seconds without a token before a KeepAlive event (default: the server's, else 5).",
    )


class GenerateStage:
    """Runs the model (or the replay script) for the request."""

    def __init__(self, params: GenerateParams, env: BuildEnv) -> None:
        self.params = params
        self.env = env

    @property
    def runtime(self) -> ModelRuntime:
        if self.env.runtime is None:
            raise ApiError("unavailable", f"Model {self.env.model_name!r} is not loaded.")
        return self.env.runtime

    def prepare(self, ctx: RequestContext) -> None:
        runtime = self.runtime
        request = ctx.request
        prompt = self.prompt_ids(ctx, runtime)
        request.sampling = request.sampling.with_defaults(runtime.sampling_defaults)
        limit = runtime.context_length
        if limit is not None and len(prompt) >= limit:
            raise ContextLengthError(len(prompt), limit)
        check_sampling(request.sampling)
        check_logit_bias(request.sampling.logit_bias, runtime.tokenizer)
        if request.mock_response is not None and not runtime.engine.accepts_mock_response:
            raise ApiError(
                "invalid_request",
                f"mock_response is only accepted by replay models; {ctx.model_name!r} runs a real model.",
                "mock_response",
            )
        thinking = thinking_limit(ctx, runtime, prompt)
        job = GenerationJob(
            request_id=ctx.request_id,
            prompt_token_ids=prompt,
            sampling=request.sampling,
            max_tokens=self.max_tokens(request, runtime, len(prompt)),
            stop_token_ids=runtime.eos_token_ids | ctx.stop_token_ids,
            logprobs=request.logprobs,
            top_logprobs=request.top_logprobs if request.logprobs else 0,
            mock_completion=request.mock_response,
            keepalive_interval=(
                self.params.keepalive_interval or ctx.keepalive_interval or DEFAULT_KEEPALIVE
            ),
            constraint=constraint(ctx, runtime),
            stop_strings=tuple(request.stop),
            prediction_token_ids=(
                encode(runtime.tokenizer, request.prediction) if request.prediction else None
            ),
            thinking=thinking,
            prompt_group=ctx.request_id if ctx.choices > 1 else None,
            group_size=ctx.choices,
            adapter=ctx.adapter,
        )
        if ctx.dry_run:
            return
        stream = runtime.engine.submit(job)
        ctx.generation = stream
        ctx.on_cancel(stream.cancel)

    def prompt_ids(self, ctx: RequestContext, runtime: ModelRuntime) -> list[int]:
        if ctx.prompt_token_ids is not None:
            prompt = list(ctx.prompt_token_ids)
        elif ctx.prompt is not None:
            prompt = encode(runtime.tokenizer, ctx.prompt)
        else:
            raise ApiError(
                "internal", "generate: no prompt was rendered (is render_template the first stage?)"
            )
        if ctx.assistant_prefill:
            prompt += encode(runtime.tokenizer, ctx.assistant_prefill)
        if not prompt:
            raise ApiError(
                "invalid_request", "The conversation rendered to an empty prompt.", "messages"
            )
        return prompt

    def max_tokens(self, request: GenerationRequest, runtime: ModelRuntime, prompt_len: int) -> int:
        if request.max_tokens is not None and request.max_tokens < 1:
            raise ApiError("invalid_request", "max_tokens must be at least 1.", "max_tokens")
        wanted = request.max_tokens or runtime.default_max_tokens
        cap = runtime.engine.max_tokens_limit
        if cap is not None:
            wanted = min(wanted, cap)
        if runtime.context_length is not None:
            wanted = min(wanted, runtime.context_length - prompt_len)
        return max(1, wanted)

    def __call__(self, events: Iterator[Event], ctx: RequestContext) -> Iterator[Event]:
        yield from events
        stream = ctx.generation
        if stream is None:
            return
        if not ctx.request.logprobs:
            yield from stream
            return
        # Later stages turn tokens into text deltas; encoders that report logprobs read
        # the sampled tokens (with their logprobs) from here, in generation order.
        records = ctx.logprob_records
        for event in stream:
            if isinstance(event, TokenText):
                records.append(event)
            yield event


def thinking_limit(
    ctx: RequestContext, runtime: ModelRuntime, prompt: list[int]
) -> ThinkingLimit | None:
    """The think block's budget (the request's, else its effort's in the model's
    `reasoning.effort_budgets`, capped by `reasoning.max_thinking_tokens`), with the
    family's markers as token ids; None where nothing limits it or the family has no
    think block. A zero budget on a prompt that opened the block closes it in the prompt
    (appended to `prompt`), so that not one reasoning token is generated."""
    markers, request = ctx.think_markers, ctx.request
    if markers is None or ctx.assistant_prefill or request.raw_prompt is not None:
        return None  # no think block, or a forced tool call's prefill closed it
    if request.reasoning.enabled is False and not ctx.prompt_opened_thinking:
        return None
    reasoning = request.reasoning
    budget = runtime.reasoning.budget(reasoning.budget_tokens, reasoning.effort)
    if budget is None:
        return None
    tokenizer = runtime.tokenizer
    close = tuple(encode(tokenizer, markers.close))
    if budget == 0 and ctx.prompt_opened_thinking:
        prompt += close
        ctx.prompt_opened_thinking = False  # the thinking stage starts in the answer
        return None
    start, end = (tuple(encode(tokenizer, m)) for m in (markers.start, markers.end))
    return ThinkingLimit(budget, start, end, close, opened=ctx.prompt_opened_thinking)


def grammar_plan(ctx: RequestContext) -> GrammarPlan | None:
    """What to enforce: a stage's plan (forced tool calls) or the client's output format."""
    if ctx.grammar_plan is not None:
        return ctx.grammar_plan
    fmt = ctx.request.output_format
    if fmt is None:
        return None
    envelope, opened = ctx.envelope, ctx.prompt_opened_thinking
    return GrammarPlan(
        lambda tokens: response_grammar(tokens, fmt, envelope, opened), param=fmt.param
    )


def constraint(ctx: RequestContext, runtime: ModelRuntime) -> Constraint | None:
    """Compile the request's grammar (off the hub; cached per model); 400 when invalid."""
    plan = grammar_plan(ctx)
    if plan is None:
        return None
    if plan is ctx.grammar_plan and runtime.engine.accepts_mock_response:
        return None  # replay streams a scripted completion: a forced call is not sampled
    compiler = runtime.grammar
    if compiler is None:
        raise ApiError(
            "invalid_request", "structured output is not available for this model.", plan.param
        )
    try:
        return run_off_hub(
            lambda: compiler.constraint(plan.build(compiler), plan.forced, plan.optional)
        )
    except GrammarError as exc:
        param = exc.param or plan.param
        raise ApiError("invalid_request", f"Invalid value for '{param}': {exc}", param) from None


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of text that continues a rendered prompt (special tokens recognized)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def check_logit_bias(bias: dict[int, float], tokenizer: Any) -> None:
    """Biased ids must be tokens of this model's vocabulary (not another model's)."""
    if not bias:
        return
    size = len(getattr(tokenizer, "_tokenizer", tokenizer))
    outside = sorted(token for token in bias if not 0 <= token < size)
    if outside:
        message = f"logit_bias: token ids {outside[:5]} are outside this model's vocabulary (0-{size - 1})."
        raise ApiError("invalid_request", message, "logit_bias")


def check_sampling(sampling: SamplingParams) -> None:
    problems = (
        ("temperature", sampling.temperature < 0, "must be >= 0"),
        ("top_p", not 0 <= sampling.top_p <= 1, "must be in [0, 1]"),
        ("top_k", sampling.top_k < 0, "must be >= 0"),
        ("min_p", not 0 <= sampling.min_p <= 1, "must be in [0, 1]"),
        ("repetition_penalty", sampling.repetition_penalty <= 0, "must be > 0"),
        ("presence_penalty", not -2 <= sampling.presence_penalty <= 2, "must be in [-2, 2]"),
        ("frequency_penalty", not -2 <= sampling.frequency_penalty <= 2, "must be in [-2, 2]"),
        (
            "logit_bias",
            not all(-100 <= v <= 100 for v in sampling.logit_bias.values()),
            "must map to [-100, 100]",
        ),
    )
    for name, bad, rule in problems:
        if bad:
            raise ApiError("invalid_request", f"{name} {rule}.", name)


@register_stage("generate", GenerateParams, role="generate")
def build_generate(params: GenerateParams, env: BuildEnv) -> GenerateStage:
    """Generate tokens with the model's engine (MLX, or replay of a scripted completion)."""
    return GenerateStage(params, env)
