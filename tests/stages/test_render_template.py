"""render_template on the real demo tokenizers and on openai-harmony."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pipeserve.engine.base import ModelRuntime
from pipeserve.errors import ApiError
from pipeserve.events import Finish, TokenText
from pipeserve.request import (
    GenerationRequest,
    Message,
    ReasoningOptions,
    ToolCall,
    ToolChoice,
    ToolSpec,
)
from pipeserve.stages import load_builtin_stages
from pipeserve.stages.base import BuildEnv, RequestContext, Stage
from pipeserve.stages.render_template import RenderParams, render_template

WEATHER = ToolSpec(
    "get_weather",
    "Weather for a city",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
)
CONVERSATION = [
    Message("system", "Be brief."),
    Message("user", "Weather in Paris?"),
    Message(
        "assistant",
        "Checking.",
        reasoning="The user wants weather; call the tool.",
        tool_calls=[ToolCall("call_1", "get_weather", '{"city": "Paris", "days": 2}')],
    ),
    Message("tool", '{"temp": 20}', tool_call_id="call_1"),
]


def make_stage(family: str, tokenizer: Any | None, **params: Any) -> Stage:
    runtime = (
        None
        if tokenizer is None
        else ModelRuntime(family, family, None, tokenizer, None, frozenset())
    )  # type: ignore[arg-type]
    return render_template(RenderParams(**params), BuildEnv("test", family, runtime))


def rendered(stage: Stage, **request: Any) -> RequestContext:
    request.setdefault("messages", [Message("user", "hi")])
    ctx = RequestContext(GenerationRequest(model="test", **request), "req-1", "test")
    stage.prepare(ctx)
    return ctx


@pytest.fixture(scope="module")
def qwen3(demo_tokenizer: Callable[[str], Any]) -> Stage:
    return make_stage("qwen3", demo_tokenizer("qwen3"), think_start="<think>")


@pytest.fixture(scope="module")
def glm(demo_tokenizer: Callable[[str], Any]) -> Stage:
    return make_stage("glm", demo_tokenizer("glm"), think_start="<think>")


def test_registered_as_render_stage() -> None:
    spec = load_builtin_stages()["render_template"]
    assert spec.role == "render" and spec.params_model is RenderParams


def test_builds_without_runtime_for_validation() -> None:
    make_stage("qwen3", None, think_start="<think>")
    make_stage("gpt-oss", None, renderer="harmony")


def test_stage_passes_events_through(qwen3: Stage) -> None:
    ctx = rendered(qwen3)
    events = [TokenText("a", 1), Finish("stop")]
    assert list(qwen3(iter(events), ctx)) == events


def test_qwen3_prompt_and_ids(qwen3: Stage, demo_tokenizer: Callable[[str], Any]) -> None:
    ctx = rendered(qwen3, messages=[Message("system", "Be brief."), Message("user", "hi")])
    assert (
        ctx.prompt
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    hf = demo_tokenizer("qwen3")._tokenizer
    assert ctx.prompt_token_ids == hf.encode(ctx.prompt, add_special_tokens=False)
    assert ctx.prompt_token_ids[0] == hf.convert_tokens_to_ids("<|im_start|>")
    assert not ctx.prompt_opened_thinking


def test_qwen3_tools_calls_results_and_reasoning(qwen3: Stage) -> None:
    prompt = rendered(qwen3, messages=CONVERSATION, tools=[WEATHER]).prompt
    assert prompt is not None
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '"name": "get_weather"' in prompt.split("</tools>\n")[0]
    assert (
        "<|im_start|>assistant\n<think>\nThe user wants weather; call the tool.\n</think>\n\nChecking.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"temp": 20}\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
    ) in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_qwen3_reasoning_of_earlier_turns_is_dropped(qwen3: Stage) -> None:
    messages = [
        Message("user", "one"),
        Message("assistant", "1", reasoning="old thoughts"),
        Message("user", "two"),
    ]
    prompt = rendered(qwen3, messages=messages).prompt
    assert prompt is not None and "old thoughts" not in prompt
    assert "<|im_start|>assistant\n1<|im_end|>" in prompt


def test_qwen3_thinking_off_closes_the_block(qwen3: Stage) -> None:
    ctx = rendered(qwen3, reasoning=ReasoningOptions(enabled=False))
    assert ctx.prompt is not None and ctx.prompt.endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert not ctx.prompt_opened_thinking
    assert (
        rendered(qwen3, reasoning=ReasoningOptions(enabled=True)).prompt == rendered(qwen3).prompt
    )


def test_thinking_switch_is_the_pipeline_s_data(demo_tokenizer: Callable[[str], Any]) -> None:
    """The template variable a request's thinking on/off sets comes from the YAML; a
    template without one (null) renders the same prompt either way."""
    off = ReasoningOptions(enabled=False)
    renamed = make_stage("qwen3", demo_tokenizer("qwen3"), thinking_switch="enable_thinking")
    assert rendered(renamed, reasoning=off).prompt.endswith("<think>\n\n</think>\n\n")  # type: ignore[union-attr]
    none = make_stage("qwen3", demo_tokenizer("qwen3"), thinking_switch=None)
    assert rendered(none, reasoning=off).prompt == rendered(none).prompt


def test_tool_choice_none_hides_tools(qwen3: Stage) -> None:
    ctx = rendered(qwen3, tools=[WEATHER], tool_choice=ToolChoice("none"))
    assert ctx.prompt is not None and "# Tools" not in ctx.prompt


@pytest.mark.parametrize("choice", [ToolChoice("required"), ToolChoice("function", "get_weather")])
def test_forced_tool_choice_renders_with_thinking_off(qwen3: Stage, choice: ToolChoice) -> None:
    ctx = rendered(qwen3, tools=[WEATHER], tool_choice=choice)
    assert ctx.prompt is not None and "# Tools" in ctx.prompt
    assert ctx.prompt.endswith("<think>\n\n</think>\n\n")


def test_chat_template_kwargs_reach_the_template(demo_tokenizer: Callable[[str], Any]) -> None:
    stage = make_stage(
        "qwen3", demo_tokenizer("qwen3"), chat_template_kwargs={"enable_thinking": False}
    )
    assert rendered(stage).prompt.endswith("</think>\n\n")  # type: ignore[union-attr]


def test_template_error_is_invalid_request(qwen3: Stage) -> None:
    with pytest.raises(ApiError) as info:
        rendered(qwen3, messages=[Message("user", "hi"), Message("tool", "{}", tool_call_id="x")])
    assert info.value.kind == "invalid_request"
    assert "tool message must follow" in info.value.message


def test_missing_runtime_is_unavailable() -> None:
    stage = make_stage("qwen3", None)
    with pytest.raises(ApiError) as info:
        rendered(stage)
    assert info.value.kind == "unavailable"


def test_glm_opens_thinking_by_default(glm: Stage) -> None:
    ctx = rendered(glm)
    assert ctx.prompt == "[gMASK]<sop><|user|>hi<|assistant|><think>"
    assert ctx.prompt_opened_thinking


def test_glm_thinking_off_closes_the_block(glm: Stage) -> None:
    ctx = rendered(glm, reasoning=ReasoningOptions(enabled=False))
    assert ctx.prompt is not None and ctx.prompt.endswith("<|assistant|><think></think>")
    assert not ctx.prompt_opened_thinking


def test_glm_tool_calls_use_arg_pairs(glm: Stage) -> None:
    prompt = rendered(glm, messages=CONVERSATION, tools=[WEATHER]).prompt
    assert prompt is not None
    assert (
        "<|assistant|><think>The user wants weather; call the tool.</think>Checking."
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
        '<|observation|><tool_response>{"temp": 20}</tool_response><|assistant|><think>'
    ) in prompt


def test_kimi_tool_sections(demo_tokenizer: Callable[[str], Any]) -> None:
    stage = make_stage("kimi", demo_tokenizer("kimi"), think_start="<think>")
    ctx = rendered(stage, messages=CONVERSATION, tools=[WEATHER])
    assert ctx.prompt is not None
    assert (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris", "days": 2}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
    ) in ctx.prompt
    assert ctx.prompt.endswith("<|im_assistant|>assistant<|im_middle|>")
    assert not ctx.prompt_opened_thinking


# --- harmony -------------------------------------------------------------------------


def harmony_reference(encoding: Any, effort: str = "MEDIUM", tools: bool = True) -> list[int]:
    """The same conversation built directly with openai-harmony's API."""
    from openai_harmony import (
        Author,
        Conversation,
        DeveloperContent,
        ReasoningEffort,
        Role,
        SystemContent,
        ToolDescription,
    )
    from openai_harmony import (
        Message as H,
    )

    developer = DeveloperContent.new().with_instructions("Be brief.")
    if tools:
        developer = developer.with_function_tools(
            [ToolDescription.new(WEATHER.name, WEATHER.description, parameters=WEATHER.parameters)]
        )
    messages = [
        H.from_role_and_content(
            Role.SYSTEM, SystemContent.new().with_reasoning_effort(getattr(ReasoningEffort, effort))
        ),
        H.from_role_and_content(Role.DEVELOPER, developer),
        H.from_role_and_content(Role.USER, "Weather in Paris?"),
        H.from_role_and_content(
            Role.ASSISTANT, "The user wants weather; call the tool."
        ).with_channel("analysis"),
        H.from_role_and_content(Role.ASSISTANT, "Checking.").with_channel("commentary"),
        H.from_role_and_content(Role.ASSISTANT, '{"city": "Paris", "days": 2}')
        .with_channel("commentary")
        .with_recipient("functions.get_weather")
        .with_content_type("<|constrain|>json"),
        H.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), '{"temp": 20}')
        .with_channel("commentary")
        .with_recipient("assistant"),
    ]
    return encoding.render_conversation_for_completion(
        Conversation.from_messages(messages), Role.ASSISTANT
    )


@pytest.fixture(scope="module")
def harmony(harmony_encoding: Any) -> Stage:
    return make_stage("gpt-oss", None, renderer="harmony")


def test_harmony_equals_openai_harmony_token_for_token(
    harmony: Stage, harmony_encoding: Any, demo_tokenizer: Callable[[str], Any]
) -> None:
    ctx = rendered(harmony, messages=CONVERSATION, tools=[WEATHER])
    assert ctx.prompt_token_ids == harmony_reference(harmony_encoding)
    assert ctx.prompt == harmony_encoding.decode(ctx.prompt_token_ids)
    assert ctx.prompt is not None and ctx.prompt.endswith("<|start|>assistant")
    assert "namespace functions" in ctx.prompt and "Reasoning: medium" in ctx.prompt
    # the demo gpt-oss tokenizer reads the rendered text back into the same ids
    hf = demo_tokenizer("gpt-oss")._tokenizer
    assert hf.encode(ctx.prompt, add_special_tokens=False) == ctx.prompt_token_ids


def test_harmony_reasoning_effort_and_tool_choice_none(
    harmony: Stage, harmony_encoding: Any
) -> None:
    ctx = rendered(
        harmony,
        messages=CONVERSATION,
        tools=[WEATHER],
        reasoning=ReasoningOptions(effort="high"),
        tool_choice=ToolChoice("none"),
    )
    assert ctx.prompt_token_ids == harmony_reference(harmony_encoding, "HIGH", tools=False)
    assert (
        ctx.prompt is not None
        and "Reasoning: high" in ctx.prompt
        and "namespace functions" not in ctx.prompt
    )


def test_harmony_minimal_prompt(harmony: Stage) -> None:
    ctx = rendered(harmony)
    assert ctx.prompt is not None and "<|start|>developer" not in ctx.prompt
    assert ctx.prompt.endswith("<|start|>user<|message|>hi<|end|><|start|>assistant")
    assert not ctx.prompt_opened_thinking


def test_harmony_rejects_unknown_kwargs() -> None:
    with pytest.raises(ValueError, match="enable_thinking"):
        make_stage(
            "gpt-oss", None, renderer="harmony", chat_template_kwargs={"enable_thinking": False}
        )


def test_trailing_assistant_message_is_continued(qwen3: Stage, glm: Stage) -> None:
    messages = [Message("user", "Name a colour."), Message("assistant", "The colour is")]
    ctx = rendered(qwen3, messages=messages)
    assert ctx.prompt is not None and ctx.prompt.endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\nThe colour is"
    )
    assert not ctx.prompt_opened_thinking
    glm_ctx = rendered(glm, messages=messages)
    assert glm_ctx.prompt is not None and glm_ctx.prompt.endswith(
        "<|assistant|></think>The colour is"
    )
    assert not glm_ctx.prompt_opened_thinking


def test_prefill_continuation_can_be_turned_off(demo_tokenizer: Callable[[str], Any]) -> None:
    stage = make_stage("qwen3", demo_tokenizer("qwen3"), continue_final_assistant=False)
    ctx = rendered(stage, messages=[Message("user", "Hi"), Message("assistant", "Hello")])
    assert ctx.prompt is not None and ctx.prompt.endswith(
        "Hello<|im_end|>\n<|im_start|>assistant\n"
    )


def test_kimi_tool_results_reuse_the_call_ids(demo_tokenizer: Callable[[str], Any]) -> None:
    stage = make_stage("kimi", demo_tokenizer("kimi"), think_start="<think>")
    prompt = rendered(stage, messages=CONVERSATION, tools=[WEATHER]).prompt
    assert (
        prompt is not None
        and '## Return of functions.get_weather:0\n{"temp": 20}<|im_end|>' in prompt
    )


def test_request_template_kwargs_override_the_pipelines(
    demo_tokenizer: Callable[[str], Any],
) -> None:
    stage = make_stage(
        "qwen3", demo_tokenizer("qwen3"), chat_template_kwargs={"enable_thinking": False, "a": 1}
    )
    ctx = rendered(stage, template_kwargs={"enable_thinking": True, "custom": "x"})
    assert ctx.prompt is not None and ctx.prompt.endswith("<|im_start|>assistant\n")
    assert stage.template_kwargs(ctx.request) == {"enable_thinking": True, "a": 1, "custom": "x"}  # type: ignore[attr-defined]
